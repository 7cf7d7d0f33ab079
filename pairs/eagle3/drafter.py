"""An EAGLE-3 head loaded against its target: checks, the shared modules, the capture hooks.

Two steps, so that a mismatch is refused before the target's weights load:

    read_head    the head's config and weights (pairs.eagle3.layout), checked against the
                 target's config.json: vocabulary, hidden size, layer count, aux layer ids,
                 every weight key and shape
    attach_head  builds the head on the loaded target (its embedding / lm_head where the
                 head has none), installs the aux-state capture on the target's layers
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from pairs.config import ModelConfig
from pairs.eagle3 import layout as L
from pairs.eagle3.capture import AuxCapture, resolve_aux_layers
from pairs.eagle3.head import Eagle3Head
from pairs.eagle3.lean import lean_head, supports_head
from pairs.eagle3.pool import Eagle3State, feed_pairs, grow_pool_eagle3
from tree.config import PoolConfig
from tree.pool import DraftDraw, Pool

SETTING = "model.drafter"


@dataclass
class HeadCheckpoint:
    """A head read from disk and checked against the target's config (no model built yet)."""

    folder: Path
    spec: L.HeadSpec
    state: dict[str, Tensor]  # canonical names
    aux_layers: tuple[int, ...]  # input convention, ascending


def check_against_target(spec: L.HeadSpec, target: PretrainedConfig, path: Path) -> None:
    vocab, hidden = target.vocab_size, target.hidden_size
    if spec.layer.vocab_size != vocab:
        raise L.refuse(
            SETTING,
            path,
            f"vocab_size: expected the target's {vocab}, found {spec.layer.vocab_size}",
        )
    if spec.target_hidden_size != hidden:
        key = (
            "target_hidden_size"
            if spec.target_hidden_size != spec.layer.hidden_size
            else "hidden_size"
        )
        raise L.refuse(
            SETTING,
            path,
            f"{key}: the head reads target hidden states of width "
            f"{spec.target_hidden_size}, but the target's hidden_size is {hidden}",
        )
    if spec.draft_vocab_size > vocab:
        raise L.refuse(
            SETTING,
            path,
            f"draft_vocab_size: expected at most the target's {vocab}, "
            f"found {spec.draft_vocab_size}",
        )


def read_head(folder: Path, target: PretrainedConfig, cfg: ModelConfig) -> HeadCheckpoint:
    """Config and weights of the head at `folder`, refused on any mismatch with `target`."""
    spec = L.read_head_config(folder, SETTING)
    cfg_path = folder / "config.json"
    check_against_target(spec, target, cfg_path)
    aux = resolve_aux_layers(
        cfg.aux_layers,
        spec.aux_layer_ids,
        cfg.aux_layer_convention,
        target.num_hidden_layers,
        str(cfg_path),
    )
    raw, weights = L.read_head_weights(folder, SETTING)
    state, origin = L.canonical_names(raw, spec, weights, SETTING)
    L.check_head_weights(state, origin, spec, len(aux), weights, SETTING)
    h = spec.layer.hidden_size
    if "embed_tokens.weight" not in state and h != target.hidden_size:
        raise L.refuse(
            SETTING,
            weights,
            f"lacks key 'embed_tokens.weight' (expected shape "
            f"{[target.vocab_size, h]}): the target's embedding has width "
            f"{target.hidden_size}, not the head's {h}",
        )
    if "lm_head.weight" not in state and (
        spec.draft_vocab_size != target.vocab_size or h != target.hidden_size
    ):
        raise L.refuse(
            SETTING,
            weights,
            f"lacks key 'lm_head.weight' (expected shape "
            f"{[spec.draft_vocab_size, h]}): the target's lm_head cannot stand in "
            "for a head of another width or vocabulary",
        )
    return HeadCheckpoint(folder, spec, state, aux)


@dataclass
class Eagle3Drafter:
    """The drafter of `model.drafter_kind=eagle3`: a head, its target's capture hooks, its ids."""

    head: Eagle3Head
    capture: AuxCapture
    aux_layers: tuple[int, ...]
    # The head's max_position_embeddings is a hard limit only with model.strict_head_positions
    # (pairs.positions); past it a run warns once (positions_warned) and decodes on.
    strict_positions: bool = False
    positions_warned: bool = False

    @property
    def config(self):  # the head's layer config: max_position_embeddings for position checks
        return self.head.config

    def new_state(self, target_cache: DynamicCache) -> Eagle3State:
        """A prompt's state: every target forward on `target_cache` now adds feature rows."""
        cache = (lean_head(self.head).new_cache() if supports_head(self.head)
                 else DynamicCache(config=self.head.config))  # fmt: skip
        return Eagle3State(cache, self.capture.track(target_cache))

    def prefill(self, state: Eagle3State, prompt: list[int]) -> None:
        """After the target cached prompt[:-1]: feed every pair but (feature n - 2, root)."""
        if len(prompt) < 2:
            raise ValueError(
                "model.drafter_kind=eagle3: the prompt has 1 token; an EAGLE-3 head drafts from "
                "the target's hidden states at the token before the root, so it needs at least 2"
            )
        feed_pairs(self.head, state, prompt, len(prompt) - 2)

    def grow(self, state: Eagle3State, tokens: list[int], root_position: int,
             cfg: PoolConfig, draw: DraftDraw | None = None) -> Pool:  # fmt: skip
        """One round's pool (`tokens`: the committed tokens, the root last)."""
        return grow_pool_eagle3(self.head, state, tokens, root_position, cfg, draw)


def build_head(spec: L.HeadSpec, n_aux: int, state: dict[str, Tensor], attn: str) -> Eagle3Head:
    """The module with `state` (canonical names) loaded; shared modules still to be attached."""
    spec.layer._attn_implementation = attn
    head = Eagle3Head(
        spec.layer,
        n_aux,
        spec.target_hidden_size,
        spec.draft_vocab_size,
        spec.norm_before_residual,
        own_embed="embed_tokens.weight" in state,
        own_lm_head="lm_head.weight" in state,
        token_ids=L.draft_token_ids(state.get("d2t"), spec.draft_vocab_size),
    )
    head.load_state_dict({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, strict=True)
    return head.eval()


def attach_head(ckpt: HeadCheckpoint, target: PreTrainedModel, cfg: ModelConfig) -> Eagle3Drafter:
    """The head on `target`'s device and dtype, sharing its embedding / lm_head where needed."""
    head = build_head(ckpt.spec, len(ckpt.aux_layers), ckpt.state, cfg.attn_implementation)
    head = head.to(device=target.device, dtype=target.dtype)
    head.share(target.get_input_embeddings(), target.get_output_embeddings())
    return Eagle3Drafter(head, AuxCapture(target, ckpt.aux_layers), ckpt.aux_layers,
                         strict_positions=cfg.strict_head_positions)  # fmt: skip


def head_ids(d: Eagle3Drafter, ckpt: HeadCheckpoint) -> dict[str, str]:
    """What trace manifests record about the drafter beyond its path and config hash."""
    return {
        "drafter_kind": "eagle3",
        "aux_layers": ",".join(map(str, d.aux_layers)),  # input convention: hidden_states[i]
        "draft_vocab_size": str(ckpt.spec.draft_vocab_size),
    }
