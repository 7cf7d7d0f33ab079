"""A semi-autoregressive drafter (DSpark, Domino) loaded against its target, and its pools,
whose children depend on the node.

Loading, the capture of the target's states, the prefill (the whole prompt; round 0's root
is the target's first token) and a round's block forward are the block drafter's
(`pairs.block.drafter`). The block gives D rows (`SemiARSpec.depth`): row j drafts the
tokens at depth j + 1, from its base logits (the kind's lm_head: DSpark's own, Domino's the
target's) plus a correction from the node they hang below (`SemiARModule.correct`): its
token (DSpark's Markov head) or a GRU state carried down its path (Domino). So a node's
children row is its own, the pool grows best-first on the corrected path probability (the
product of the corrected conditionals, `tree.growth.grow_tree_pool`), ancestor-closed, at most
D deep. Per-node state lives in each level's small tensors: a level's nodes' states are
gathered from their parents' rows (`Level.prev_row`), as the growth's other tensors are.

DSpark's confidence head gives each block row a logit of its draft's acceptance (trained
towards 1 - TV(q, p), `recipes.pocket.dspark`). The pool carries the calibrated value of
row 1, the block's first draft token, as the drafter's estimate for its top first-level
candidate (`Pool.confidence`, the trace's `draft_confidence`): sigmoid(z_1 / T_1), z_1 the
head's logit of row 1 after the root token, T_1 the sequential temperature scaling's
temperature of position 1 from `recipe.json` beside the drafter (`sts.temperatures[0]`,
written by `python -m decode.train_pocket.dspark`; DeepSpec's own layout has no key for it,
so a drafter without that file is uncalibrated: T_1 = 1, as the manifest says). It reads the
block's hidden state only: the pool, and every other column, are the same without it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel

from pairs.block.drafter import (
    FIRST_ROUND_NOTE,
    BlockCheckpoint,
    BlockDrafter,
    BlockState,
    window_ids,
)
from pairs.block.layout import DRAFTER_SETTING, refusal
from pairs.config import ModelConfig
from pairs.eagle3.capture import AuxCapture
from pairs.semiar.layout import READERS, SemiARSpec, read_semiar_weights
from pairs.semiar.module import SemiARModule
from specrank.settings.errors import Refusal
from tree.config import PoolConfig
from tree.growth import Level, grow_tree_pool
from tree.pool import DraftDraw, Pool, level_sizes


@dataclass
class SemiARCheckpoint(BlockCheckpoint):
    semi: SemiARSpec | None = None


CALIBRATION_FILE = "recipe.json"  # beside the drafter: the pocket recipe's facts, STS's among them


def confidence_temperature(folder: Path) -> float | None:
    """The fitted STS temperature of block position 1 (`sts.temperatures[0]` of
    `recipe.json` in `folder`, `recipes.pocket.dspark.calibrate`); None without that file or
    key (the head is then read uncalibrated). A present but unusable value is refused."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        return None
    try:
        facts = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise refusal(DRAFTER_SETTING, path, f"not valid JSON ({err})") from err
    temps = (facts.get("sts") or {}).get("temperatures") if isinstance(facts, dict) else None
    if temps is None:
        return None
    t = temps[0] if isinstance(temps, list) and temps else None
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t <= 0:
        raise refusal(DRAFTER_SETTING, path, f"sts.temperatures: expected a list of positive "
                     f"temperatures, one a block position, found {temps!r}")  # fmt: skip
    return float(t)


def read_semiar(kind: str, folder: Path, target: PretrainedConfig) -> SemiARCheckpoint:
    """Config and weights at `folder`, refused on any mismatch with `target`'s config."""
    semi = READERS[kind](folder)
    spec, path, n = semi.block, folder / "config.json", target.num_hidden_layers
    where = "" if kind == "dspark" else "dflash_config."
    if spec.layer.hidden_size != target.hidden_size:
        raise refusal(DRAFTER_SETTING, path, f"hidden_size: the drafter reads the target's states "
                     f"of width {target.hidden_size}, found {spec.layer.hidden_size}")  # fmt: skip
    if semi.vocab_size != target.vocab_size:
        raise refusal(DRAFTER_SETTING, path, f"vocab_size: its drafts are the target's ids "
                     f"({target.vocab_size}), found {semi.vocab_size}")  # fmt: skip
    if spec.num_target_layers is not None and spec.num_target_layers != n:
        raise refusal(DRAFTER_SETTING, path, f"num_target_layers: expected the target's {n}, "
                     f"found {spec.num_target_layers}")  # fmt: skip
    low, high = (-1, n - 2) if kind == "dspark" else (0, n - 1)
    ids = spec.target_layer_ids
    if min(ids) < low or max(ids) > high:
        why = ("; DeepSpec refuses the last layer, whose output transformers gives after the "
               "final norm") if kind == "dspark" else ""  # fmt: skip
        raise refusal(DRAFTER_SETTING, path, f"{where}target_layer_ids {list(ids)}: expected ids in "
                     f"[{low}, {high}] of the target's {n} layers{why}")  # fmt: skip
    if spec.mask_token_id >= target.vocab_size:
        raise refusal(DRAFTER_SETTING, path, f"{where}mask_token_id: {spec.mask_token_id} is not a "
                     f"row of the target's embedding ({target.vocab_size} rows)")  # fmt: skip
    return SemiARCheckpoint(folder, spec, read_semiar_weights(folder, semi), semi)


@dataclass
class SemiARDrafter(BlockDrafter):
    """The drafter of `model.drafter_kind=dspark|domino` (see the module doc)."""

    semi: SemiARSpec | None = None
    gru_embed: nn.Module | None = None  # Domino: the target's embedding, the GRU's input
    # DSpark: the confidence head's temperature at block position 1 (None: uncalibrated, 1)
    confidence_temperature: float | None = None

    def grow(self, state: BlockState, tokens: list[int], root_position: int,
             cfg: PoolConfig, draw: DraftDraw | None = None) -> Pool:  # fmt: skip
        hidden = self.block_hidden(state, tokens[-1], root_position)
        d = self.semi.depth
        rows = hidden[:d] if self.semi.shift else hidden[1 : d + 1]
        draft = _CorrectedDraft(self.lm_head(rows), rows, self.module, self.gru_embed,
                                tokens[-1], root_position)  # fmt: skip
        pool = grow_tree_pool(draft, cfg, draw)
        pool.confidence = self.first_confidence(rows[0], tokens[-1])
        return pool

    def first_confidence(self, row: Tensor, root: int) -> Tensor | None:
        """sigmoid(z_1 / T_1) [] float32 of block row 1 (`row` [H]) after the `root` token:
        the drafter's calibrated estimate of its first draft token's acceptance (module
        doc); None without a confidence head (Domino, a DSpark drafter without one)."""
        prev = torch.tensor([root], device=row.device)
        z = self.module.confidence(row[None], prev)
        if z is None:
            return None
        return torch.sigmoid(z[0] / (self.confidence_temperature or 1.0))

    def check_pool(self, pool: PoolConfig, setting: str) -> None:
        check_semiar_depth(self.semi, pool, setting)


@dataclass
class _CorrectedDraft:
    """A `tree.growth.TreeDraft` whose nodes' children rows are base[depth] + their own
    correction; `state` holds the last level's nodes' states (Domino's GRU), in its rows."""

    base: Tensor  # [D, V]
    hidden: Tensor  # [D, H]
    module: SemiARModule
    embed: nn.Module | None  # Domino's GRU input: the target's embedding
    root: int
    n_context: int
    token_ids: Tensor | None = None
    shared_rows: bool = False
    state: Tensor | None = None

    def _rows(self, depth: int, prev: Tensor, parent: Tensor | None) -> Tensor:
        bias, self.state = self.module.correct(depth, self.hidden[depth], prev, self.embed,
                                               parent)  # fmt: skip
        base = self.base[depth].expand(prev.shape[0], -1)
        return base if bias is None else base + bias.to(base.dtype)

    def root_logits(self, n_tree: int) -> Tensor:
        root = torch.tensor([self.root], device=self.base.device)
        return self._rows(0, root, None)

    def level_logits(self, level: Level) -> Tensor:
        parent = self.state
        if parent is not None:
            rows = level.prev_row if level.prev_row is not None else torch.zeros_like(level.token)
            parent = parent.index_select(0, rows)
        return self._rows(level.depth, level.token, parent)


def check_semiar_depth(semi: SemiARSpec, pool: PoolConfig, setting: str) -> None:
    """A pool deeper than the block's rows reach is refused by name, before loading."""
    depth = len(level_sizes(pool))
    if depth > semi.depth:
        raise Refusal(
            f"pool.expand_steps={pool.expand_steps}: a pool of depth {depth}, but the {semi.kind} drafter at "
            f"{setting} drafts {semi.depth} positions a block (block_size "
            f"{semi.block.block_size}); set pool.expand_steps <= {semi.depth - 1}"
        )


def attach_semiar(ckpt: SemiARCheckpoint, target: PreTrainedModel, cfg: ModelConfig
                  ) -> SemiARDrafter:  # fmt: skip
    """The drafter on `target`'s device and dtype. DSpark drafts with its own embedding and
    lm_head, as its reference does (they start as copies of the target's and may be trained;
    those its config's `shared_with_target` names are filled from the target's); Domino with
    the target's."""
    semi = ckpt.semi
    semi.block.layer._attn_implementation = cfg.attn_implementation
    module = SemiARModule(semi)
    state = dict(ckpt.state)
    filled = {
        "embed_tokens": target.get_input_embeddings(),
        "lm_head": target.get_output_embeddings(),
    }
    for name in semi.shared_with_target:  # left out of the file: the target's (config says so)
        state[f"{name}.weight"] = filled[name].weight.detach()
    module.load_state_dict(state, strict=True)
    module = module.to(device=target.device, dtype=target.dtype).eval()
    own = semi.kind == "dspark"
    embed = module.embed_tokens if own else target.get_input_embeddings()
    head = module.lm_head if own else target.get_output_embeddings()
    return SemiARDrafter(module, semi.block, AuxCapture(target, semi.block.capture_ids), embed,
                         head, strict_positions=cfg.strict_head_positions,
                         window=cfg.drafter_window, semi=semi,
                         gru_embed=None if own else target.get_input_embeddings(),
                         confidence_temperature=confidence_temperature(ckpt.folder)
                         if own else None)  # fmt: skip


def semiar_ids(d: SemiARDrafter) -> dict[str, str]:
    """What trace manifests record about the drafter beyond its path and config hash."""
    semi = d.semi
    out = window_ids(d.window) | {
        "drafter_kind": semi.kind,
        "block_size": str(semi.block.block_size),
        "target_layer_ids": ",".join(map(str, semi.block.target_layer_ids)),
        "layer_id_convention": "output",
        "variant": semi.variant,
        "pool_conditionals": f"block rows corrected by {semi.conditions_on}",
        "first_round": FIRST_ROUND_NOTE,
    }
    if semi.kind == "dspark":  # what the trace's draft_confidence is
        t = d.confidence_temperature
        has_head = getattr(d.module, "confidence_head", None) is not None
        out["draft_confidence"] = (
            "none: no confidence head" if not has_head
            else f"sigmoid(z_1 / {t!r}), T_1 from {CALIBRATION_FILE} sts.temperatures[0]"
            if t is not None else f"sigmoid(z_1): uncalibrated (no {CALIBRATION_FILE} sts)")  # fmt: skip
    if semi.kind == "domino":
        out |= {
            "shift_label": str(semi.shift).lower(),
            "pure_draft_prefix_len": str(semi.plain_rows),
        }
    return out
