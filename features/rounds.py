"""What a round's first-level features are computed from: `RoundArrays`.

`RoundArrays` holds only what the drafter knows *before* verification: the
pool, the context and the retained rows of the previous round evaluated at
this round's first-level candidates. Target probabilities, argmaxes, the
accepted path and the continuation are not fields, so a feature function that
takes a `RoundArrays` cannot look ahead. The offline extractor builds one from
a trace shard (`features.from_trace`); the online decoder builds one for the
round in hand (R = 1, `RoundArrays.one_round`).

`RoundBlocks` holds the same fields stacked by kind (the retained-row arrays in
one [6, R, N1] block, the per-round scalars in one float and one int block):
what the compiled feature kernels read. `RoundArrays.blocks()` stacks a batch;
the online decoder builds the blocks of its round directly
(`RoundBlocks.one_round`, a handful of array calls instead of ~40).

Layout: R rounds, pools padded to P entries in pool order (depths
non-decreasing, parents before children), so the first-level candidates are
the first n1[r] entries of round r. The row features are [R, N1] with
N1 = max n1, aligned with those entries. Missing values are NaN, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tree.retained import ROW_KINDS, TOKEN_ONLY_MAX

PAD_DEPTH = 0  # depth of padding entries (real candidates have depth >= 1)
TOKEN_ONLY_WIDTH = TOKEN_ONLY_MAX + 1  # up to 24 token-only rows, plus the root's row
FL_ROWS = (
    "fl_cache_logprob",
    "fl_same_logprob",
    "fl_prev_logprob",
    "fl_matched_logprob",
    "fl_token_only_mean_logprob",
    "fl_token_only_max_logprob",
)
ROW_SCALARS = (
    "cache_age",
    "prev_tree_root_count",
    *(f"{k}_{stat}" for stat in ("entropy", "top1_prob") for k in ROW_KINDS),
)
ROW_ARGMAX = tuple(f"{k}_argmax" for k in ROW_KINDS)
# What a round's features read from the retained rows (tree.retained.row_inputs).
ROW_INPUTS = (*FL_ROWS, *ROW_SCALARS, *ROW_ARGMAX, "token_only_argmax")
_ROW_INPUT_SET = frozenset(ROW_INPUTS)
# rows of RoundBlocks.scalars (float32) and RoundBlocks.ints (int32)
SCALAR_FIELDS = ("prev_accepted", *ROW_SCALARS)
INT_FIELDS = ("root_token", "prompt_length", "round_index", "tokens_before", *ROW_ARGMAX)
_PER_ROUND = (  # the [R] fields
    "root_token", "prompt_length", "round_index", "tokens_before", "prev_accepted",
    *ROW_SCALARS, *ROW_ARGMAX,
)  # fmt: skip


@dataclass(frozen=True)
class RoundArrays:
    """Pre-verification inputs of R rounds (see the module docstring for the layout)."""

    cand_token: np.ndarray  # [R, P] int32; padding: -1
    cand_parent: np.ndarray  # [R, P] int32 pool index of the parent; -1 = root (and padding)
    cand_depth: np.ndarray  # [R, P] int8, 1..D; padding: 0
    cand_draft_logprob: np.ndarray  # [R, P] float32 per-edge log q; padding: NaN
    cand_expanded: np.ndarray  # [R, P] bool; padding: False
    root_token: np.ndarray  # [R] int32
    prompt_length: np.ndarray  # [R] int32, tokens
    round_index: np.ndarray  # [R] int32, 0-based within the prompt
    tokens_before: np.ndarray  # [R] int32, tokens emitted before this round
    prev_accepted: np.ndarray  # [R] float32, accepted length of the previous round; NaN at round 0
    fl_cache_logprob: np.ndarray  # [R, N1] float32, token-keyed cache row; NaN = absent
    fl_same_logprob: np.ndarray  # [R, N1] float32, same-token row; NaN = absent
    fl_prev_logprob: np.ndarray  # [R, N1] float32, preceding row; NaN = absent
    cache_age: np.ndarray  # [R] float32, rounds since the cache row was stored; NaN = absent
    prev_tree_root_count: np.ndarray  # [R] float32, previous-tree prefixes ending in the root token
    # -- beyond the paper's rows (trace schema v3): all known before verification ---------------
    fl_matched_logprob: np.ndarray  # [R, N1] float32, matched row; NaN = previous round not covered
    fl_token_only_mean_logprob: np.ndarray  # [R, N1] float32, mean over token-only rows; NaN = none
    fl_token_only_max_logprob: np.ndarray  # [R, N1] float32, max over token-only rows; NaN = none
    token_only_argmax: (
        np.ndarray
    )  # [R, TOKEN_ONLY_WIDTH] int32, each token-only row's argmax; -1 pad
    cache_entropy: np.ndarray  # [R] float32 nats of each role row (NaN = absent) ...
    same_entropy: np.ndarray
    prev_entropy: np.ndarray  # (the preceding row with the continuation zeroed)
    matched_entropy: np.ndarray
    cache_top1_prob: np.ndarray  # [R] float32 ... its largest probability ...
    same_top1_prob: np.ndarray
    prev_top1_prob: np.ndarray
    matched_top1_prob: np.ndarray
    cache_argmax: np.ndarray  # [R] int32 ... and its most probable token (-1 = absent)
    same_argmax: np.ndarray
    prev_argmax: np.ndarray
    matched_argmax: np.ndarray

    @property
    def n_rounds(self) -> int:
        return self.cand_token.shape[0]

    def rows(self, start: int, stop: int) -> RoundArrays:
        """Rounds [start, stop) as their own batch (row-feature width trimmed to their max n1)."""
        n1 = self.n_first_level()[start:stop]
        width = int(n1.max(initial=0))
        return RoundArrays(
            **{
                name: value[start:stop, :width] if name.startswith("fl_") else value[start:stop]
                for name, value in self.__dict__.items()
            }
        )

    def n_first_level(self) -> np.ndarray:
        """[R] int32: first-level candidates per round."""
        return (self.cand_depth == 1).sum(axis=1, dtype=np.int32)

    def blocks(self) -> RoundBlocks:
        """The fields stacked for the feature kernels (shapes checked first, naming the array)."""
        self.check()
        self.check_row_width(int(self.n_first_level().max(initial=0)))
        return RoundBlocks(
            cand_token=self.cand_token,
            cand_parent=self.cand_parent,
            cand_depth=self.cand_depth,
            cand_draft_logprob=self.cand_draft_logprob,
            cand_expanded=self.cand_expanded,
            rows=np.stack([getattr(self, name) for name in FL_ROWS]).astype(np.float32, copy=False),
            scalars=np.stack([getattr(self, name) for name in SCALAR_FIELDS]).astype(
                np.float32, copy=False
            ),
            ints=np.stack([getattr(self, name) for name in INT_FIELDS]).astype(
                np.int32, copy=False
            ),
            token_only_argmax=self.token_only_argmax,
        )

    def check(self) -> None:
        """Refuse arrays of the wrong shapes, naming the array.

        The pool's content (finite log q, pool order, parents at the depth above) is
        checked where it is read, by `features.subtree.pool_pass`, and the row
        features' width, which needs the first-level counts, by `check_row_width`.
        """
        R, P = self.cand_token.shape
        for name in ("cand_parent", "cand_depth", "cand_draft_logprob", "cand_expanded"):
            _expect_shape(name, getattr(self, name), (R, P))
        for name in _PER_ROUND:
            _expect_shape(name, getattr(self, name), (R,))
        _expect_shape("token_only_argmax", self.token_only_argmax, (R, TOKEN_ONLY_WIDTH))

    def check_row_width(self, width: int) -> None:
        """Refuse row features [R, N1] whose N1 is not `width` (= max n1)."""
        R = self.cand_token.shape[0]
        for name in FL_ROWS:
            _expect_shape(name, getattr(self, name), (R, width))

    @classmethod
    def one_round(cls, **round_inputs) -> RoundArrays:
        """One round (R = 1) from `RoundBlocks.one_round`'s keywords: 1-D pool arrays [P],
        the context and the retained-row inputs `rows` (`tree.retained.row_inputs`).
        """
        b = RoundBlocks.one_round(**round_inputs)
        return cls(
            cand_token=b.cand_token.astype(np.int32),
            cand_parent=b.cand_parent.astype(np.int32),
            cand_depth=b.cand_depth.astype(np.int8),
            cand_draft_logprob=b.cand_draft_logprob,
            cand_expanded=b.cand_expanded,
            token_only_argmax=b.token_only_argmax,
            **dict(zip(FL_ROWS, b.rows, strict=True)),
            **dict(zip(SCALAR_FIELDS, b.scalars, strict=True)),
            **dict(zip(INT_FIELDS, b.ints, strict=True)),
        )


@dataclass(frozen=True)
class RoundBlocks:
    """RoundArrays' fields of R rounds stacked by kind: what the feature kernels read."""

    cand_token: np.ndarray  # [R, P] integers (any integer dtype); padding: -1
    cand_parent: np.ndarray  # [R, P] integers; -1 = root (and padding)
    cand_depth: np.ndarray  # [R, P] integers, 1..D; padding: 0
    cand_draft_logprob: np.ndarray  # [R, P] float32; padding: NaN
    cand_expanded: np.ndarray  # [R, P] bool
    rows: np.ndarray  # [6, R, N1] float32: FL_ROWS
    scalars: np.ndarray  # [11, R] float32: SCALAR_FIELDS (NaN = absent)
    ints: np.ndarray  # [8, R] int32: INT_FIELDS (-1 = no such row)
    token_only_argmax: np.ndarray  # [R, TOKEN_ONLY_WIDTH] int32; -1 pad

    @classmethod
    def one_round(
        cls,
        *,
        cand_token: np.ndarray,
        cand_parent: np.ndarray,
        cand_depth: np.ndarray,
        cand_draft_logprob: np.ndarray,
        cand_expanded: np.ndarray,
        root_token: int,
        prompt_length: int,
        round_index: int,
        tokens_before: int,
        prev_accepted: int | None,
        rows: dict,
    ) -> RoundBlocks:
        """One round (R = 1) from 1-D pool arrays [P] and the retained-row inputs `rows`.

        `rows` holds exactly ROW_INPUTS (`tree.retained.row_inputs`): first-level
        arrays [n1] (NaN or None where a row is absent), scalars (None when absent) and
        the token-only rows' argmaxes. The pool arrays keep their integer dtypes.
        """
        _check_row_keys(rows)
        depth = np.asarray(cand_depth)
        n1 = int(np.count_nonzero(depth == 1))
        # Few array calls: each costs several microseconds once a model pass has evicted
        # the interpreter's caches, which is the state the decoder calls this in.
        block = _row_block(rows, n1)
        nan = float("nan")
        scalars = np.array(
            [nan if prev_accepted is None else prev_accepted]
            + [nan if rows[k] is None else rows[k] for k in ROW_SCALARS],
            dtype=np.float32,
        )[:, None]
        ints = np.array(
            [root_token, prompt_length, round_index, tokens_before]
            + [-1 if rows[k] is None else rows[k] for k in ROW_ARGMAX],
            dtype=np.int32,
        )[:, None]
        only = _token_only_block(rows["token_only_argmax"])
        logprob = cand_draft_logprob
        if not (isinstance(logprob, np.ndarray) and logprob.dtype == np.float32):
            logprob = np.asarray(logprob, dtype=np.float32)
        expanded = cand_expanded
        if not (isinstance(expanded, np.ndarray) and expanded.dtype == np.bool_):
            expanded = np.asarray(expanded, dtype=bool)
        return cls(
            cand_token=np.asarray(cand_token)[None],
            cand_parent=np.asarray(cand_parent)[None],
            cand_depth=depth[None],
            cand_draft_logprob=logprob[None],
            cand_expanded=expanded[None],
            rows=block,
            scalars=scalars,
            ints=ints,
            token_only_argmax=only,
        )


def _check_row_keys(rows: dict) -> None:
    """Refuse retained-row inputs that are not exactly ROW_INPUTS, naming the difference."""
    if rows.keys() != _ROW_INPUT_SET:
        raise ValueError(
            f"RoundArrays.one_round: rows must hold {sorted(ROW_INPUTS)}; "
            f"missing {sorted(set(ROW_INPUTS) - set(rows))}, extra {sorted(set(rows) - set(ROW_INPUTS))}"
        )


def _row_block(rows: dict, n1: int) -> np.ndarray:
    """The FL_ROWS of one round as a [6, 1, n1] float32 block; an absent row stays NaN."""
    block = np.full((len(FL_ROWS), 1, n1), np.nan, dtype=np.float32)
    for i, name in enumerate(FL_ROWS):
        x = rows[name]
        if x is not None:
            if len(x) != n1:
                raise ValueError(
                    f"RoundArrays.{name}: expected shape (1, {n1}), found (1, {len(x)})"
                )
            block[i, 0] = x
    return block


def _token_only_block(argmax) -> np.ndarray:
    """The token-only rows' argmaxes of one round, -1 padded to [1, TOKEN_ONLY_WIDTH]."""
    only = np.full((1, TOKEN_ONLY_WIDTH), -1, dtype=np.int32)
    if len(argmax):
        only[0, : len(argmax)] = argmax
    return only


def _expect_shape(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"RoundArrays.{name}: expected shape {shape}, found {x.shape}")
