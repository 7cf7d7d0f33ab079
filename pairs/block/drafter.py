"""A block drafter loaded against its target, and the pool it grows each round.

Loading is two steps, so that a mismatch is refused before the target's weights load:

    read_block    config.json and the weights (`pairs.block.layout`), checked against the
                  target's config: hidden size, layer ids in range, the mask id in the
                  target's embedding, `num_target_layers`
    attach_block  builds the module on the target's device and dtype, with the target's
                  embedding and lm_head, and installs the capture of the target's states
                  (`pairs.eagle3.capture.AuxCapture`, which takes them from every target pass
                  decoding runs anyway: the verification pass gives the next round's context)

Prefill (`decode.stream.prefill`, as the reference's `dflash_generate`): the target caches
the whole prompt of n tokens and draws the first output token from its last row; that token
is round 0's root, at position n, with the prompt's states [0, n) as its context.

One round, the root (the bonus token) at position r:

    context   the committed positions the drafter has not seen, [n_fed, r): their target
              states (from the passes that verified them) become each layer's context K/V
    block     one forward over [root, mask x (block_size - 1)] at positions r .. r+bs-1
    pool      `tree.growth.grow_tree_pool` over the block's marginals: a node at depth d takes
              row d - 1 as its children's draft distribution, whatever its ancestors. So the
              pool is ancestor-closed, its paths ranked by the product of per-position
              marginals, top-k children per expanded node, depth at most block_size - 1. With
              pool.top_k=1 pool.expand=1 it is the block's argmax chain.
    after     `BlockState.commit`: the captured rows follow the target cache's compaction

Context window (`model.drafter_window` W): the block attends to the latest W context
positions only, and the state holds no more. A drafter trained on windows of W context
positions never saw a longer context, and its rows degrade past it. The cut is exact: each
context key is rotated to its absolute position when computed, so the held keys and values
of [r - W, r) equal a from-scratch computation over those positions alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from pairs.block.layout import (
    DRAFTER_SETTING,
    BlockSpec,
    read_block_config,
    read_block_weights,
    refusal,
)
from pairs.block.module import BlockDrafterModule, ContextKV
from pairs.config import ModelConfig
from pairs.eagle3.capture import AuxCapture, FeatureRows
from specrank.settings.errors import Refusal
from tree.config import PoolConfig
from tree.growth import Level, grow_tree_pool
from tree.pool import DraftDraw, Pool, level_sizes

# The README and the trace manifest say this of every block drafter's pool.
MARGINALS_NOTE = "block marginals: not conditioned on earlier draft tokens"
# ... and this of its first round: stores recorded when round 0's root was the prompt's last
# token (context: the prompt minus that token) lack it, and are not resumed into
FIRST_ROUND_NOTE = "root: the target's first token, context: the whole prompt"


@dataclass
class BlockCheckpoint:
    """A drafter read from disk and checked against the target's config (no module built)."""

    folder: Path
    spec: BlockSpec
    state: dict[str, Tensor]


def read_block(folder: Path, target: PretrainedConfig) -> BlockCheckpoint:
    """Config and weights of the drafter at `folder`, refused on any mismatch with `target`."""
    spec = read_block_config(folder)
    path, n, ids = folder / "config.json", target.num_hidden_layers, spec.target_layer_ids
    if spec.layer.hidden_size != target.hidden_size:
        raise refusal(DRAFTER_SETTING, path, f"hidden_size: the drafter reads the target's embedding and "
                     f"states of width {target.hidden_size}, found {spec.layer.hidden_size}")  # fmt: skip
    if spec.num_target_layers is not None and spec.num_target_layers != n:
        raise refusal(DRAFTER_SETTING, path, f"num_target_layers: expected the target's {n}, found "
                     f"{spec.num_target_layers}")  # fmt: skip
    if max(ids) > n - 1 or min(ids) < 0:
        raise refusal(DRAFTER_SETTING, path, f"dflash_config.target_layer_ids {list(ids)}: expected ids "
                     f"in [0, {n - 1}] (id i reads hidden_states[i + 1], the state leaving "
                     f"layer i of the target's {n})")  # fmt: skip
    if spec.mask_token_id >= target.vocab_size:
        raise refusal(DRAFTER_SETTING, path, f"dflash_config.mask_token_id: {spec.mask_token_id} is not a "
                     f"row of the target's embedding ({target.vocab_size} rows)")  # fmt: skip
    return BlockCheckpoint(folder, spec, read_block_weights(folder, spec))


@dataclass
class BlockState:
    """One prompt's drafting state beside the target's cache."""

    features: FeatureRows  # target states of the cache's positions from n_fed on
    # per layer K/V of positions [0, n_fed), or its latest `BlockDrafter.window` positions
    ctx: ContextKV = field(default_factory=list)
    n_fed: int = 0
    cache: DynamicCache | None = None  # no drafter KV survives a round (Stream's slot)

    def commit(self, keep_prefix: int, keep: list[int], target_length: int) -> None:
        """After the target cache was compacted to [0, keep_prefix) + keep (now `target_length`)."""
        self.features.compact(keep_prefix, keep)
        if self.features.end != target_length:
            raise RuntimeError(
                f"block drafter: target states held up to {self.features.end}, the target "
                f"cache {target_length}: a target pass ran outside the capture"
            )


@dataclass
class BlockDrafter:
    """The drafter of `model.drafter_kind=block`: module, the target's shared modules, capture."""

    module: BlockDrafterModule
    spec: BlockSpec
    capture: AuxCapture
    embed: torch.nn.Module  # the target's input embedding
    lm_head: torch.nn.Module  # the target's output head
    strict_positions: bool = False
    positions_warned: bool = False
    window: int | None = None  # model.drafter_window: the latest context positions attended to
    # decode.stream.prefill caches the whole prompt and draws the first token from the target
    first_from_target = True

    @property
    def config(self):  # the drafter's config: max_position_embeddings for position checks
        return self.spec.layer

    def new_state(self, target_cache: DynamicCache) -> BlockState:
        return BlockState(self.capture.track(target_cache))

    def prefill(self, state: BlockState, prompt: list[int]) -> None:
        """Nothing to feed yet: the target's prefill of the whole prompt captured its states,
        and the first round, whose root is the target's first token at position len(prompt),
        takes them as its context (`decode.stream.prefill`)."""

    @torch.inference_mode()
    def block_hidden(self, state: BlockState, root: int, root_position: int) -> Tensor:
        """The block's final hidden states [block_size, H]: row j at position r + j."""
        # The states of [n_fed, r) must be held; the root's own may be too (a covering
        # round cached it), and waits for the next round.
        if state.features.start != state.n_fed or state.features.end < root_position:
            raise RuntimeError(
                f"block drafter: target states held for [{state.features.start}, "
                f"{state.features.end}), expected at least [{state.n_fed}, {root_position}) "
                f"before the root at {root_position}"
            )
        if root_position > state.n_fed:  # the newly committed positions join the context
            rows = state.features.rows(state.n_fed, root_position)
            dev = rows.device
            new = self.module.context(rows, torch.arange(state.n_fed, root_position, device=dev))
            state.ctx = new if not state.ctx else [
                (torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))
                for (k0, v0), (k1, v1) in zip(state.ctx, new, strict=True)
            ]  # fmt: skip
            if self.window is not None:  # trimmed as it is held: memory stays bounded
                state.ctx = [(k[:, -self.window :], v[:, -self.window :]) for k, v in state.ctx]
            state.n_fed = root_position
            state.features.drop_before(root_position)
        bs, dev = self.spec.block_size, self.embed.weight.device
        ids = torch.full((bs,), self.spec.mask_token_id, dtype=torch.long, device=dev)
        ids[0] = root
        positions = torch.arange(root_position, root_position + bs, device=dev)
        return self.module(self.embed(ids), positions, state.ctx)

    @torch.inference_mode()
    def marginals(self, state: BlockState, root: int, root_position: int) -> Tensor:
        """The block's logits [block_size - 1, V]: row j - 1 for the token at r + j."""
        return self.lm_head(self.block_hidden(state, root, root_position)[1:])

    def check_pool(self, pool: PoolConfig, setting: str) -> None:
        """A pool deeper than the drafter's rows reach is refused (`check_pool_depth`)."""
        check_pool_depth(self.spec, pool, setting)

    def grow(self, state: BlockState, tokens: list[int], root_position: int,
             cfg: PoolConfig, draw: DraftDraw | None = None) -> Pool:  # fmt: skip
        """One round's pool over the block's marginals (`tokens`: committed, the root last).

        With `draw` (T_d > 0) each position's tokens are drawn from its tempered marginal: a
        chain is DFlash's sampled block, a tree Gumbel-top-k children of every node."""
        rows = self.marginals(state, tokens[-1], root_position)
        return grow_tree_pool(_MarginalDraft(rows, root_position), cfg, draw)


@dataclass
class _MarginalDraft:
    """A `tree.growth.TreeDraft` whose rows are the block's marginals, one per depth."""

    rows: Tensor  # [block_size - 1, V]
    n_context: int
    token_ids: Tensor | None = None
    shared_rows: bool = True  # a level's nodes share one row

    def root_logits(self, n_tree: int) -> Tensor:
        return self.rows[:1]

    def level_logits(self, level: Level) -> Tensor:
        d = level.depth  # a node at depth d: its children's marginal is row d
        return self.rows[d : d + 1]


def check_window(value: object) -> None:
    """`model.drafter_window`: null or an int >= 1, refused by name before anything loads."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise Refusal(
        f"The 'model.drafter_window' must be null (the whole context) or an int >= 1 (the "
        f"latest context positions a block drafter attends to). Got {value!r} instead."
    )


def check_pool_depth(spec: BlockSpec, pool: PoolConfig, setting: str) -> None:
    """A pool deeper than the block has no marginal for its last levels: refused by name."""
    depth = len(level_sizes(pool))
    if depth > spec.block_size - 1:
        raise Refusal(
            f"pool.expand_steps={pool.expand_steps}: a pool of depth {depth} needs block_size >= {depth + 1}, "
            f"but the block drafter at {setting} has block_size {spec.block_size} (its "
            f"marginals cover depths 1..{spec.block_size - 1}); set pool.expand_steps <= "
            f"{spec.block_size - 2}"
        )


def attach_block(ckpt: BlockCheckpoint, target: PreTrainedModel, cfg: ModelConfig) -> BlockDrafter:
    """The drafter on `target`'s device and dtype, with its embedding, lm_head and states."""
    spec = ckpt.spec
    spec.layer._attn_implementation = cfg.attn_implementation
    module = BlockDrafterModule(spec.layer, len(spec.target_layer_ids), spec.context_mixing)
    module.load_state_dict(ckpt.state, strict=True)
    module = module.to(device=target.device, dtype=target.dtype).eval()
    return BlockDrafter(module, spec, AuxCapture(target, spec.capture_ids),
                        target.get_input_embeddings(), target.get_output_embeddings(),
                        strict_positions=cfg.strict_head_positions,
                        window=cfg.drafter_window)  # fmt: skip


def window_ids(window: int | None) -> dict[str, str]:
    """The manifest's record of `model.drafter_window`: none for the whole context, so stores
    recorded before the setting existed resume; a windowed run drafts otherwise and does not."""
    return {} if window is None else {"drafter_window": str(window)}


def block_ids(d: BlockDrafter) -> dict[str, str]:
    """What trace manifests record about the drafter beyond its path and config hash."""
    # DFlash's shared fc is left out, so stores recorded before the setting existed resume
    mixing = {} if d.spec.context_mixing == "shared" else {"context_mixing": d.spec.context_mixing}
    mixing |= window_ids(d.window)
    return mixing | {
        "drafter_kind": "block",
        "block_size": str(d.spec.block_size),
        # as written (output convention: id i = hidden_states[i + 1], leaving layer i)
        "target_layer_ids": ",".join(map(str, d.spec.target_layer_ids)),
        "layer_id_convention": "output",
        "pool_marginals": MARGINALS_NOTE,
        "first_round": FIRST_ROUND_NOTE,
    }
