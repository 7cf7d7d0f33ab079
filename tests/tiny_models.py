"""Tiny random target/drafter pairs for the decoder tests (built in a tmp dir, loaded like real ones)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tok_models
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from pairs.config import ModelConfig
from pairs.models import ModelPair, load_model_pair

transformers.utils.logging.disable_progress_bar()  # quiet save/load bars in test output


def tiny_model_config(root: Path, arch: str, attn: str = "sdpa", **kw) -> ModelConfig:
    """Write a tiny pair under `root` (once) and return the ModelConfig that names it."""
    if not (root / "target" / "config.json").exists():
        template = TINY_CHAT_TEMPLATE if arch == "qwen3" else None  # Qwen3: chat; Llama: plain
        build_tiny_pair(root, arch, chat_template=template, **kw)
    return ModelConfig(
        name=f"tiny_{arch}",
        target=str(root / "target"),
        drafter=str(root / "drafter"),
        attn_implementation=attn,
    )


def tiny_pair(root: Path, arch: str, attn: str = "sdpa", **kw) -> ModelPair:
    return load_model_pair(tiny_model_config(root, arch, attn, **kw))


class one_thread:  # lower-case: reads as a context manager
    """Run torch on one thread: the test machine's cores are shared, and tiny ops gain nothing."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


TINY_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# A Qwen3-like template: one user turn, generation prompt, and the empty think
# block that Qwen3's non-thinking mode inserts.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def tiny_tokenizer(
    chat_template: str | None = None, extra_chars: str = ""
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over printable ASCII (~100 tokens). Offline; no downloads.

    Hand-built because every real tokenizer would need a hub download; `tokenizers`'
    WordLevel model with a one-character split is the smallest faithful stand-in.
    """
    chars = [chr(i) for i in range(32, 127)] + ["\n", *extra_chars]
    vocab = {t: i for i, t in enumerate(TINY_SPECIALS + chars)}
    tk = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    specials = "|".join(re.escape(s) for s in TINY_SPECIALS)
    # Specials first so "<|im_start|>" stays one token, then one token per character.
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(f"{specials}|[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.add_special_tokens({"additional_special_tokens": TINY_SPECIALS[3:]})
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def tiny_config(arch: str, vocab_size: int, hidden: int = 32, layers: int = 2, **kw):
    """A small Llama or Qwen3 config (2 layers, 4 heads, GQA 2) with long enough positions."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **kw,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden // 4, **common)
    raise ValueError(f"tiny model 'arch' must be 'llama' or 'qwen3'. Got {arch!r} instead.")


def _random_model(config, seed: int, init_std: float) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # A larger init than the default 0.02 makes rows peaked, so greedy argmaxes
    # are far from ties and sampled laws are far from uniform (sharper tests).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
    return model.eval()


def build_tiny_pair(
    root: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    init_std: float = 0.25,
    draft_noise: float = 0.1,
    chat_template: str | None = None,
    drafter_tokenizer: PreTrainedTokenizerFast | None = None,
) -> tuple[Path, Path]:
    """Write a random target and a correlated drafter to `root/target`, `root/drafter`.

    The drafter is the target with relative Gaussian noise `draft_noise` on every
    weight matrix, so drafts agree with the target often but not always. Both are
    saved with `save_pretrained` and meant to be read back by `load_model_pair`,
    the same path real checkpoints take. `vocab_size` defaults to the tokenizer's
    size; a smaller value restricts the model to the first ids (tiny-law tests).
    """
    root = Path(root)
    tok = tiny_tokenizer(chat_template)
    n_vocab = vocab_size or len(tok)
    target = _random_model(tiny_config(arch, n_vocab, hidden, layers), seed, init_std)
    drafter = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * init_std * draft_noise)
    paths = root / "target", root / "drafter"
    for model, path, t in ((target, paths[0], tok), (drafter, paths[1], drafter_tokenizer or tok)):
        model.save_pretrained(path)
        t.save_pretrained(path)
    return paths
