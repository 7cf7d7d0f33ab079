"""Byte-level BPE tokenizer of the pocket pair, and token streams with loss masks."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from recipes.pocket.config import TokenizerConfig
from recipes.pocket.corpus import DOC_SEP, END, SPECIAL_TOKENS

# `<|role|>\n{content}<|end|>\n` per message; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def fit_tokenizer(texts: list[str], cfg: TokenizerConfig, seed: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE fitted on up to `cfg.train_chars` characters sampled from `texts`."""
    if cfg.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"pocket.tokenizer.vocab_size: expected at least {256 + len(SPECIAL_TOKENS) + 1} "
            f"(bytes + special tokens + one merge), found {cfg.vocab_size}"
        )
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    sample, chars = [], 0
    for i in order:
        if chars >= cfg.train_chars:
            break
        sample.append(texts[i])
        chars += len(texts[i])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=DOC_SEP,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (END, DOC_SEP)],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_docs(
    tok: PreTrainedTokenizerFast, docs: list[tuple[str, list[tuple[int, int]]]]
) -> tuple[np.ndarray, np.ndarray]:
    """One stream of all documents: ids [n] (uint16) and loss mask [n] (bool).

    A token is trained on when its first character lies in one of its document's spans.
    """
    ids_parts, mask_parts = [], []
    for lo in range(0, len(docs), 512):
        chunk = docs[lo : lo + 512]
        enc = tok._tokenizer.encode_batch([t for t, _ in chunk])
        for (_, spans), e in zip(chunk, enc, strict=True):
            ids = np.asarray(e.ids, dtype=np.uint16)
            starts = np.asarray([o[0] for o in e.offsets], dtype=np.int64)
            mask = np.zeros(len(ids), dtype=bool)
            for a, b in spans:
                mask |= (starts >= a) & (starts < b)
            ids_parts.append(ids)
            mask_parts.append(mask)
    if not ids_parts:
        return np.zeros(0, np.uint16), np.zeros(0, bool)
    return np.concatenate(ids_parts), np.concatenate(mask_parts)


def save_stream(path: Path, ids: np.ndarray, mask: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, ids=ids, mask=mask)


def load_stream(path: Path) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing; run the 'tokenizer' stage of recipes.pocket first"
        )
    with np.load(path) as z:
        return z["ids"], z["mask"]
