"""First-level candidate features and labels (docs/method.md#features): the functions shared online and offline.

`first_level_features(rounds)` turns R rounds' pre-verification arrays into
one value per first-level candidate, flattened in (round, pool index) order:
N = sum of n1 over the rounds. The offline extractor calls it on a trace
shard; the online decoder calls it on the round in hand (R = 1, N = n1), so
the two cannot drift. Missing values are NaN (never 0); the candidate table
stores them as nulls.

Draft distribution at the root: the pool holds only the drafter's top n1
first tokens, so `root_draft_entropy` is the entropy of those n1 draft
probabilities renormalised to sum to 1, and `root_draft_top1` is the largest
draft probability itself (the drafter's exact top-1 mass).

How: compiled per-round loops (numba: `features.kernels`, and `features.subtree`
for the pool below each candidate) write every feature into one block per dtype,
so a round costs a few calls whatever R is (the online decoder's R = 1 used to
pay ~150 small numpy calls), and the kernels run inside one compiled call
(`_features`). Sums keep numpy's pairwise order; exponentials and logs are the
compiled code's (libm's), which differ from numpy's vectorised ones in the last bit
on some inputs: the values equal the former numpy implementation to float rounding
(`tests/test_features.py`), and online and offline values are bitwise equal (one
code path). Sums run over a round's own n1 candidates, never over a
batch's padding, so a round's values never depend on its batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from features.kernels import draft_mass, fill
from features.registry import FEATURES, FILL_STEPS, PER_KIND_STEPS, SUBTREE_STEPS
from features.rounds import FL_ROWS, INT_FIELDS, SCALAR_FIELDS, RoundArrays, RoundBlocks
from features.subtree import pool_error, pool_pass, subtree_stats
from specrank.runtime.jit import njit
from tree.retained import ROW_KINDS

# features.kernels.fill reads the input blocks' rows by position: this order (features.rounds)
assert FL_ROWS[:4] == tuple(f"fl_{k}_logprob" for k in ("cache", "same", "prev", "matched"))
assert (
    "prev_accepted", "cache_age", "prev_tree_root_count",
    *(f"{k}_{s}" for s in ("entropy", "top1_prob") for k in ("cache", "same", "prev", "matched")),
) == SCALAR_FIELDS, "features.rounds.SCALAR_FIELDS changed: update features.kernels.fill"  # fmt: skip
assert INT_FIELDS[:4] == ("root_token", "prompt_length", "round_index", "tokens_before")

# name -> numpy dtype of every feature `first_level_features` returns (the order is the table's)
FEATURE_DTYPES: dict[str, type] = {f.name: f.dtype for f in FEATURES}

LABEL_DTYPES: dict[str, type] = {
    "label_target_prob": np.float32,  # p(x1 | c) at T (the unit-temperature softmax at T = 0)
    "label_is_argmax": np.bool_,  # x1 is the root row's argmax (the greedy label)
}


# The kernel writes each feature as one row of the output block of its dtype.
F32 = tuple(f.name for f in FEATURES if f.dtype is np.float32)
I32 = tuple(f.name for f in FEATURES if f.dtype is np.int32)
B8 = tuple(f.name for f in FEATURES if f.dtype is np.bool_)
assert len(F32) + len(I32) + len(B8) == len(FEATURES), "a feature dtype without a block"
_BLOCK = {np.float32: F32, np.int32: I32, np.bool_: B8}


def _step_rows(step: str) -> tuple:
    """The block rows a kernel step writes, in the order of its entries' slots (per row
    kind for the per-kind steps: features.registry)."""
    entries = [f for f in FEATURES if f.slot[0] == step]
    if step not in PER_KIND_STEPS:
        return tuple(_BLOCK[f.dtype].index(f.name) for f in sorted(entries, key=lambda f: f.slot))
    return tuple(
        tuple(
            _BLOCK[f.dtype].index(f.name)
            for f in sorted((f for f in entries if f.slot[1] == k), key=lambda f: f.slot)
        )
        for k in range(len(ROW_KINDS))
    )


# what features.kernels.fill writes where (its `out`), and features.subtree.subtree_stats
OUT_ROWS = tuple(_step_rows(step) for step in FILL_STEPS)
_SUB32, _SUBI32 = (_step_rows(step) for step in SUBTREE_STEPS)
# name -> (block, row) of every feature; blocks: 0 float32, 1 int32, 2 bool
FEATURE_LAYOUT = {
    n: (b, names.index(n))
    for n in FEATURE_DTYPES
    for b, names in enumerate((F32, I32, B8))
    if n in names
}


def first_level_index(n_first_level: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(round_of, cand_index), both [N]: the round and pool index of each output value."""
    n1 = np.asarray(n_first_level, dtype=np.int64)  # [R]
    round_of = np.repeat(np.arange(n1.size), n1)  # [N]
    starts = np.cumsum(n1) - n1  # [R] first output position of each round
    cand_index = np.arange(round_of.size) - starts[round_of]  # [N]
    return round_of, cand_index


def first_level_features(rounds: RoundArrays) -> FirstLevelFeatures:
    """Every docs/method.md#features feature of every first-level candidate: name -> [N] array (FEATURE_DTYPES)."""
    return features_of_blocks(rounds.blocks())


def features_of_blocks(b: RoundBlocks) -> FirstLevelFeatures:
    """`first_level_features` of rounds given as `RoundBlocks` (the online decoder's call)."""
    o32, oi32, ob, error, width = _features(
        b.cand_depth, b.cand_parent, b.cand_draft_logprob, b.cand_token, b.cand_expanded,
        b.rows, b.scalars, b.ints, b.token_only_argmax,
    )  # fmt: skip
    for code, (r, i, value) in enumerate(error.tolist()):
        if r >= 0:
            raise pool_error(code, r, i, value, b.cand_depth)
    if b.rows.shape != (len(FL_ROWS), b.cand_depth.shape[0], width):
        raise ValueError(
            f"RoundBlocks.rows: expected shape {(len(FL_ROWS), b.cand_depth.shape[0], width)}, "
            f"found {b.rows.shape}"
        )
    return FirstLevelFeatures(o32, oi32, ob)


@njit(nogil=True, error_model="numpy")
def _features(depth, parent, logprob, token, expanded, rows, scalars, ints, only_argmax):
    """Every kernel step in one call: (o32, oi32, ob, pool_pass errors, first-level width).

    One call per round keeps the online decoder's cost low once the models' passes have
    evicted the interpreter's caches (each call from Python pays its dispatch again).
    Returns empty blocks, with the error or a width other than the rows' (the caller
    raises), before any step reads past what the pool holds.
    """
    n1, cum, error = pool_pass(depth, parent, logprob)
    width = np.int64(n1.max()) if n1.size else np.int64(0)
    bad = (error[:, 0] >= 0).any() or rows.shape[1] != depth.shape[0] or rows.shape[2] != width
    if bad:
        return (np.empty((len(F32), 0), np.float32), np.empty((len(I32), 0), np.int32),
                np.empty((len(B8), 0), np.bool_), error, width)  # fmt: skip
    e = np.exp(cum)  # [R, P]: q(x1) at depth 1, exp(cumulative score) below
    qn, mass, n = draft_mass(e, n1, width)
    log_qn = np.zeros_like(qn)
    for r in range(qn.shape[0]):
        for i in range(qn.shape[1]):
            if qn[r, i] > 0:
                log_qn[r, i] = np.log(qn[r, i])
    o32 = np.empty((len(F32), n), dtype=np.float32)
    oi32 = np.empty((len(I32), n), dtype=np.int32)
    ob = np.empty((len(B8), n), dtype=np.bool_)
    subtree_stats(depth, parent, cum, e, n1, o32, oi32, _SUB32, _SUBI32)
    fill(n1, token, expanded, cum, e, qn, log_qn, mass, rows, scalars, ints, only_argmax,
         o32, oi32, ob, OUT_ROWS)  # fmt: skip
    return o32, oi32, ob, error, width


class FirstLevelFeatures(Mapping):
    """name -> [N] array (FEATURE_DTYPES order), each a row of one output block per dtype.

    A read-only mapping: rows are viewed when asked for, not all at once; `design_rows`
    gives a model's design matrix in a few calls (`rerank.serving.OnlinePredictor.design`).
    """

    def __init__(self, o32: np.ndarray, oi32: np.ndarray, ob: np.ndarray) -> None:
        self.blocks = (o32, oi32, ob)

    def __getitem__(self, name: str) -> np.ndarray:
        b, row = FEATURE_LAYOUT[name]
        return self.blocks[b][row]

    def __iter__(self):
        return iter(FEATURE_DTYPES)

    def __len__(self) -> int:
        return len(FEATURE_DTYPES)

    def design_rows(self, out: np.ndarray, layout: DesignLayout) -> None:
        """Write the features of `layout` into rows of out [F, N] (float32, as astype casts)."""
        for b, (dest, rows) in enumerate(layout.rows):
            if dest.size:
                out[dest] = self.blocks[b][rows]


@dataclass(frozen=True)
class DesignLayout:
    """Where a feature list's first-level features sit in the output blocks."""

    rows: tuple[tuple[np.ndarray, np.ndarray], ...]  # per block: (columns of X, block rows)

    @classmethod
    def of(cls, names: list[str]) -> DesignLayout:
        """For the columns of `names` that are first-level features (others are left out)."""
        per = [([], []) for _ in range(3)]
        for j, name in enumerate(names):
            if name in FEATURE_LAYOUT:
                b, row = FEATURE_LAYOUT[name]
                per[b][0].append(j)
                per[b][1].append(row)
        return cls(
            tuple((np.array(d, dtype=np.int64), np.array(r, dtype=np.int64)) for d, r in per)
        )


def first_level_labels(
    cand_token: np.ndarray,
    cand_target_prob: np.ndarray,
    root_argmax: np.ndarray,
    n_first_level: np.ndarray,
) -> dict[str, np.ndarray]:
    """Labels of the first-level candidates, [N] in the order of `first_level_features`.

    cand_token, cand_target_prob: [R, >= max n1] in pool order; root_argmax, n_first_level: [R].
    These come from verification and must never feed a feature.
    """
    round_of, cand_index = first_level_index(n_first_level)
    token = cand_token[round_of, cand_index]
    return {
        "label_target_prob": cand_target_prob[round_of, cand_index].astype(np.float32),
        "label_is_argmax": token == np.asarray(root_argmax)[round_of],
    }
