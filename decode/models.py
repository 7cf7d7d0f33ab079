"""Target and drafter: loading from local checkpoints, and tiny random pairs for tests.

Batch contract: every decoding stream runs at batch size 1 (one prompt, one KV
cache per model). Tree attention puts the *tree* on the sequence axis, so the
batch axis is never used; `check_batch_one` enforces this at the entry of every
forward helper rather than letting a batch of 2 silently mix two caches.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tok_models
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from decode.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class ModelPair:
    """A loaded target/drafter pair sharing one tokenizer."""

    target: PreTrainedModel
    drafter: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]  # any of these ends generation (tokenizer's and generation config's)
    ids: dict[str, str]  # provenance stored in trace manifests (paths + config hashes)

    @property
    def device(self) -> torch.device:
        return self.target.device


def check_batch_one(input_ids: Tensor, who: str) -> None:
    """Refuse anything but one stream: input ids must be [1, n]."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"{who}: decoding runs at batch size 1 (one prompt per stream); "
            f"expected input ids of shape [1, n], got {tuple(input_ids.shape)}"
        )


def _checkpoint_dir(path: str, setting: str) -> Path:
    p = Path(path)
    if not p.is_dir() or not (p / "config.json").is_file():
        what = "no such folder" if not p.exists() else "no config.json in"
        raise FileNotFoundError(
            f"{setting}: {what} '{path}' (expected a local Hugging Face checkpoint folder "
            f"with config.json, weights and tokenizer files)"
        )
    return p


def _config_sha(folder: Path) -> str:
    return hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()


def _torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(
            f"The 'model.dtype' must be one of {sorted(DTYPES)}. Got {name!r} instead."
        )
    return DTYPES[name]


def load_causal_lm(path: str, cfg: ModelConfig, setting: str) -> PreTrainedModel:
    """One model from a local folder, in eval mode, on `cfg.device` in `cfg.dtype`."""
    folder = _checkpoint_dir(path, setting)
    if cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"The 'model.attn_implementation' must be one of {list(ATTN_IMPLEMENTATIONS)}. "
            f"Got {cfg.attn_implementation!r} instead."
        )
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=_torch_dtype(cfg.dtype),
        attn_implementation=cfg.attn_implementation,
        trust_remote_code=cfg.trust_remote_code,
        local_files_only=True,  # never reach a model hub
    )
    return model.to(cfg.device).eval()


def tokenizer_differences(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> list[str]:
    """Human-readable differences between two tokenizers (empty when they agree)."""
    va, vb = a.get_vocab(), b.get_vocab()
    ia = {i: t for t, i in va.items()}
    ib = {i: t for t, i in vb.items()}
    ids = sorted(i for i in set(ia) | set(ib) if ia.get(i) != ib.get(i))
    out = [f"id {i}: target {ia.get(i)!r} vs drafter {ib.get(i)!r}" for i in ids]
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(a, name) != getattr(b, name):
            out.append(f"{name}: target {getattr(a, name)} vs drafter {getattr(b, name)}")
    return out


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's and the generation config's (chat models add <|im_end|>)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(e) for e in eos)
    return frozenset(ids)


def load_model_pair(cfg: ModelConfig) -> ModelPair:
    """Target, drafter and their shared tokenizer; refuses a drafter with another tokenizer."""
    target_dir = _checkpoint_dir(cfg.target, "model.target")
    drafter_dir = _checkpoint_dir(cfg.drafter, "model.drafter")
    tok_t = AutoTokenizer.from_pretrained(
        target_dir, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )
    tok_d = AutoTokenizer.from_pretrained(
        drafter_dir, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )
    diff = tokenizer_differences(tok_t, tok_d)
    if diff:
        shown = "; ".join(diff[:5]) + (
            f"; ... ({len(diff)} differences in all)" if len(diff) > 5 else ""
        )
        raise ValueError(
            f"model.drafter: the tokenizer at '{cfg.drafter}' differs from the target's at "
            f"'{cfg.target}' ({shown}); a drafter must share the target's tokenizer"
        )
    target = load_causal_lm(cfg.target, cfg, "model.target")
    drafter = load_causal_lm(cfg.drafter, cfg, "model.drafter")
    # Every token id the tokenizer can produce must be a row of both embedding tables.
    for name, m in (("target", target), ("drafter", drafter)):
        rows = m.get_input_embeddings().num_embeddings
        if rows < len(tok_t):
            raise ValueError(
                f"model.{name}: embedding table has {rows} rows but the tokenizer has {len(tok_t)} tokens"
            )
    ids = {
        "target": str(cfg.target),
        "drafter": str(cfg.drafter),
        "target_config_sha256": _config_sha(target_dir),
        "drafter_config_sha256": _config_sha(drafter_dir),
    }
    return ModelPair(target, drafter, tok_t, eos_token_ids(target, tok_t), ids)


# -- tiny random pairs (tests and benchmarks) ---------------------------------------------------

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
