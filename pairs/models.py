"""Target and drafter: loading from local checkpoints (Hugging Face folders).

Batch contract: every decoding stream runs at batch size 1 (one prompt, one KV
cache per model). Tree attention puts the *tree* on the sequence axis, so the
batch axis is never used; `check_batch_one` enforces this at the entry of every
forward helper rather than letting a batch of 2 silently mix two caches.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from pairs.block.drafter import (
    BlockDrafter,
    attach_block,
    block_ids,
    check_pool_depth,
    check_window,
    read_block,
)
from pairs.block.layout import read_block_config
from pairs.config import ModelConfig
from pairs.eagle3.capture import CONVENTIONS
from pairs.eagle3.drafter import Eagle3Drafter, attach_head, head_ids, read_head
from pairs.eagle3.layout import read_head_config
from pairs.gguf import converted_folder, gguf_file
from pairs.loading import LOADING
from pairs.semiar.drafter import attach_semiar, check_semiar_depth, read_semiar, semiar_ids
from pairs.semiar.layout import READERS as SEMIAR_READERS
from specrank.settings.checks import check_choice
from specrank.settings.errors import Refusal
from tree.config import PoolConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
# A standalone causal LM, or a drafter from the target's hidden states: an EAGLE-3 head or a
# block drafter (the kinds: DRAFTERS, below).
Drafter = PreTrainedModel | Eagle3Drafter | BlockDrafter
# Drafters that keep a state beside the target's cache (`new_state`, `prefill`, `grow`) and
# no KV cache of their own across rounds.
STATE_DRAFTERS = (Eagle3Drafter, BlockDrafter)


@dataclass
class ModelPair:
    """A loaded target/drafter pair sharing one tokenizer."""

    target: PreTrainedModel
    drafter: Drafter
    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]  # any of these ends generation (tokenizer's and generation config's)
    ids: dict[str, str]  # provenance stored in trace manifests (paths + config hashes)

    @property
    def device(self) -> torch.device:
        return self.target.device


def checkpoint_dir(path: str, setting: str, fetch: str | None = None) -> Path:
    """The Hugging Face folder `path` names: the folder itself, or for a GGUF file (or a
    folder holding one) its converted copy (`pairs.gguf`). `fetch`: the command that
    provides a missing checkpoint, named in the refusal."""
    p = Path(path)
    gguf = gguf_file(p, setting)
    if gguf is not None:
        return _converted(gguf.resolve(), gguf.stat().st_size, gguf.stat().st_mtime_ns, setting)
    if not p.is_dir() or not (p / "config.json").is_file():
        what = "no such folder" if not p.exists() else "no config.json in"
        hint = f"; run `{fetch}` to fetch it" if fetch and not p.exists() else ""
        raise FileNotFoundError(
            f"{setting}: {what} '{path}' (expected a local Hugging Face checkpoint folder "
            f"with config.json, weights and tokenizer files, or a GGUF file){hint}"
        )
    return p


@functools.lru_cache(maxsize=8)
def _converted(gguf: Path, size: int, mtime_ns: int, setting: str) -> Path:
    """One sha256 of a file per process (an 8B file takes seconds to hash); the size and
    modification time in the key make a changed file hash again."""
    return converted_folder(gguf, setting)


def _config_sha(folder: Path) -> str:
    return hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()


def _torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise Refusal(f"The 'model.dtype' must be one of {sorted(DTYPES)}. Got {name!r} instead.")
    return DTYPES[name]


def load_causal_lm(path: str, cfg: ModelConfig, setting: str) -> PreTrainedModel:
    """One model from a local folder, in eval mode, on `cfg.device` in `cfg.dtype`."""
    folder = checkpoint_dir(path, setting)
    if cfg.attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise Refusal(
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


def load_eagle3_pair(cfg: ModelConfig) -> ModelPair:
    """Target and EAGLE-3 head (pairs.eagle3); the head is checked before the target loads."""
    target_dir = checkpoint_dir(cfg.target, "model.target", cfg.fetch)
    head_dir = checkpoint_dir(cfg.drafter, "model.drafter")
    tok = AutoTokenizer.from_pretrained(
        target_dir, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )
    target_cfg = AutoConfig.from_pretrained(
        target_dir, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )
    ckpt = read_head(head_dir, target_cfg, cfg)
    target = load_causal_lm(cfg.target, cfg, "model.target")
    _check_embeddings("target", target, len(tok))
    drafter = attach_head(ckpt, target, cfg)
    ids = _pair_ids(cfg, target_dir, head_dir) | head_ids(drafter, ckpt)
    return ModelPair(target, drafter, tok, eos_token_ids(target, tok), ids)


def load_block_pair(cfg: ModelConfig) -> ModelPair:
    """Target and block drafter (pairs.block); the drafter is checked before the target loads."""
    target_dir = checkpoint_dir(cfg.target, "model.target", cfg.fetch)
    drafter_dir = checkpoint_dir(cfg.drafter, "model.drafter")
    local = {"local_files_only": True, "trust_remote_code": cfg.trust_remote_code}
    tok = AutoTokenizer.from_pretrained(target_dir, **local)
    ckpt = read_block(drafter_dir, AutoConfig.from_pretrained(target_dir, **local))
    target = load_causal_lm(cfg.target, cfg, "model.target")
    _check_embeddings("target", target, len(tok))
    drafter = attach_block(ckpt, target, cfg)
    ids = _pair_ids(cfg, target_dir, drafter_dir) | block_ids(drafter)
    return ModelPair(target, drafter, tok, eos_token_ids(target, tok), ids)


def load_semiar_pair(cfg: ModelConfig) -> ModelPair:
    """Target and a DSpark or Domino drafter (pairs.semiar), checked before the target loads."""
    target_dir = checkpoint_dir(cfg.target, "model.target", cfg.fetch)
    drafter_dir = checkpoint_dir(cfg.drafter, "model.drafter")
    local = {"local_files_only": True, "trust_remote_code": cfg.trust_remote_code}
    tok = AutoTokenizer.from_pretrained(target_dir, **local)
    target_cfg = AutoConfig.from_pretrained(target_dir, **local)
    ckpt = read_semiar(cfg.drafter_kind, drafter_dir, target_cfg)
    target = load_causal_lm(cfg.target, cfg, "model.target")
    _check_embeddings("target", target, len(tok))
    drafter = attach_semiar(ckpt, target, cfg)
    ids = _pair_ids(cfg, target_dir, drafter_dir) | semiar_ids(drafter)
    return ModelPair(target, drafter, tok, eos_token_ids(target, tok), ids)


def _pair_ids(cfg: ModelConfig, target_dir: Path, drafter_dir: Path) -> dict[str, str]:
    """What identifies a pair in the traces' manifest: the paths and their configs' sha256."""
    return {
        "target": str(cfg.target),
        "drafter": str(cfg.drafter),
        "target_config_sha256": _config_sha(target_dir),
        "drafter_config_sha256": _config_sha(drafter_dir),
    }


def _check_embeddings(name: str, model, n_tokens: int) -> None:
    """Every token id the tokenizer can produce must be a row of the model's embedding table."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < n_tokens:
        raise Refusal(
            f"model.{name}: embedding table has {rows} rows but the tokenizer has {n_tokens} tokens"
        )


def load_model_pair(cfg: ModelConfig) -> ModelPair:
    """Target, drafter and their shared tokenizer; refuses a drafter with another tokenizer."""
    kind = drafter_kind(cfg)
    _torch_dtype(cfg.dtype)  # every model setting refused before anything is read
    with LOADING:  # one load at a time (pairs.loading)
        return kind.load(cfg)


def load_standalone_pair(cfg: ModelConfig) -> ModelPair:
    """Target and a standalone drafter LM; refuses a drafter with another tokenizer."""
    target_dir = checkpoint_dir(cfg.target, "model.target", cfg.fetch)
    drafter_dir = checkpoint_dir(cfg.drafter, "model.drafter")
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
        raise Refusal(
            f"model.drafter: the tokenizer at '{cfg.drafter}' differs from the target's at "
            f"'{cfg.target}' ({shown}); a drafter must share the target's tokenizer"
        )
    target = load_causal_lm(cfg.target, cfg, "model.target")
    drafter = load_causal_lm(cfg.drafter, cfg, "model.drafter")
    for name, m in (("target", target), ("drafter", drafter)):
        _check_embeddings(name, m, len(tok_t))
    ids = _pair_ids(cfg, target_dir, drafter_dir)
    return ModelPair(target, drafter, tok_t, eos_token_ids(target, tok_t), ids)


def _standalone_config(folder: Path, cfg: ModelConfig) -> PretrainedConfig:
    return AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=cfg.trust_remote_code
    )


def _eagle3_config(folder: Path, cfg: ModelConfig) -> PretrainedConfig:
    return read_head_config(folder).layer


def _block_config(folder: Path, cfg: ModelConfig) -> PretrainedConfig:
    return read_block_config(folder).layer


def _block_pool(folder: Path, cfg: ModelConfig, pool: PoolConfig) -> None:
    check_pool_depth(read_block_config(folder), pool, cfg.drafter)


def _semiar_config(folder: Path, cfg: ModelConfig) -> PretrainedConfig:
    return SEMIAR_READERS[cfg.drafter_kind](folder).block.layer


def _semiar_pool(folder: Path, cfg: ModelConfig, pool: PoolConfig) -> None:
    check_semiar_depth(SEMIAR_READERS[cfg.drafter_kind](folder), pool, cfg.drafter)


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter (`model.drafter_kind`): how its pair loads, what it drafts from,
    and what a run records of it. A new kind: its package, an entry here, one config."""

    name: str
    load: Callable[[ModelConfig], ModelPair]  # the pair, every setting checked first
    read_config: Callable[[Path, ModelConfig], PretrainedConfig]  # config.json alone: positions
    # drafts from the target's hidden states: its position table is its own, a soft limit
    # (pairs.positions) unless model.strict_head_positions
    head: bool
    pool: str  # what grows the pool (tree.pool.grow_pool calls the drafter object's passes)
    target_states: tuple[str, ...]  # target states each draft step reads
    settings: tuple[str, ...]  # model.* settings only this kind reads (refused for the others)
    manifest_fields: tuple[str, ...]  # ModelPair.ids: the trace manifest's model section
    verifiers: tuple[str, ...] = ("greedy", "sampling")  # laws it is verified under
    # the pool settings checked against the drafter's config.json, before anything loads
    check_pool: Callable[[Path, ModelConfig, PoolConfig], None] | None = None


_PAIR_FIELDS = ("target", "drafter", "target_config_sha256", "drafter_config_sha256")
DRAFTERS = {
    k.name: k
    for k in (
        DrafterKind("standalone", load_standalone_pair, _standalone_config, head=False,
                    pool="its own KV cache, one forward per pool level", target_states=(),
                    settings=(), manifest_fields=_PAIR_FIELDS),
        DrafterKind("eagle3", load_eagle3_pair, _eagle3_config, head=True,
                    pool="pairs.eagle3.pool: the head's cache over the target's aux states",
                    target_states=("aux hidden states (model.aux_layers)",),
                    settings=("aux_layers",),
                    manifest_fields=(*_PAIR_FIELDS, "drafter_kind", "aux_layers",
                                     "draft_vocab_size")),
        DrafterKind("block", load_block_pair, _block_config, head=True,
                    pool="pairs.block.drafter: one block forward, its per-position marginals",
                    target_states=("hidden states leaving dflash_config.target_layer_ids",),
                    settings=("drafter_window",),
                    manifest_fields=(*_PAIR_FIELDS, "drafter_kind", "block_size",
                                     "target_layer_ids", "layer_id_convention",
                                     "pool_marginals", "first_round"),
                    check_pool=_block_pool),
        *(DrafterKind(name, load_semiar_pair, _semiar_config, head=True,
                      pool="pairs.semiar.drafter: one block forward, each node's children row "
                           "corrected from its own path",
                      target_states=("hidden states leaving target_layer_ids",),
                      settings=("drafter_window",),
                      manifest_fields=(*_PAIR_FIELDS, "drafter_kind", "block_size",
                                       "target_layer_ids", "layer_id_convention", "variant",
                                       "pool_conditionals", "first_round"),
                      check_pool=_semiar_pool) for name in ("dspark", "domino")),
    )
}  # fmt: skip


def drafter_kind(cfg: ModelConfig) -> DrafterKind:
    """The entry of `model.drafter_kind`, its settings checked (before anything is read)."""
    check_choice("model.drafter_kind", cfg.drafter_kind, list(DRAFTERS))
    check_choice("model.aux_layer_convention", cfg.aux_layer_convention, CONVENTIONS)
    kind = DRAFTERS[cfg.drafter_kind]
    for entry in DRAFTERS.values():
        for setting in entry.settings:
            value = getattr(cfg, setting)
            if setting not in kind.settings and value is not None:
                shown = list(value) if isinstance(value, (list, tuple)) else repr(value)
                owners = " | ".join(n for n, e in DRAFTERS.items() if setting in e.settings)
                raise Refusal(
                    f"The 'model.{setting}' applies to model.drafter_kind={owners} only. Got "
                    f"{shown} with model.drafter_kind={cfg.drafter_kind!r}."
                )
    check_window(cfg.drafter_window)
    return kind
