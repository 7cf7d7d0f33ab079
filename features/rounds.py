"""What a round's first-level features are computed from: `RoundArrays`.

`RoundArrays` holds only what the drafter knows *before* verification: the
pool, the context and the retained rows of the previous round evaluated at
this round's first-level candidates. Target probabilities, argmaxes, the
accepted path and the continuation are not fields, so a feature function that
takes a `RoundArrays` cannot look ahead. The offline extractor builds one from
a trace shard (`features.from_trace`); the online decoder builds one for the
round in hand (R = 1, `RoundArrays.one_round`).

Layout: R rounds, pools padded to P entries in pool order (depths
non-decreasing, parents before children), so the first-level candidates are
the first n1[r] entries of round r. The row features are [R, N1] with
N1 = max n1, aligned with those entries. Missing values are NaN, never 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD_DEPTH = 0  # depth of padding entries (real candidates have depth >= 1)


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

    def check(self) -> None:
        """Refuse arrays that break the batch contract, naming the array and the round."""
        R, P = self.cand_token.shape
        for name in ("cand_parent", "cand_depth", "cand_draft_logprob", "cand_expanded"):
            _expect_shape(name, getattr(self, name), (R, P))
        for name in (
            "root_token",
            "prompt_length",
            "round_index",
            "tokens_before",
            "prev_accepted",
        ):
            _expect_shape(name, getattr(self, name), (R,))
        for name in ("cache_age", "prev_tree_root_count"):
            _expect_shape(name, getattr(self, name), (R,))
        real = self.cand_depth > 0  # [R, P] non-padding entries
        if np.isnan(self.cand_draft_logprob[real]).any():
            raise ValueError(
                "RoundArrays.cand_draft_logprob: expected finite log q on every candidate, found NaN"
            )
        n1 = self.n_first_level()
        width = int(n1.max(initial=0))
        for name in ("fl_cache_logprob", "fl_same_logprob", "fl_prev_logprob"):
            _expect_shape(name, getattr(self, name), (R, width))
        # first-level candidates must be exactly the first n1 entries of each pool
        is_first = np.arange(P)[None, :] < n1[:, None]  # [R, P]
        bad = np.flatnonzero(((self.cand_depth == 1) != is_first).any(axis=1))
        if bad.size:
            raise ValueError(
                f"RoundArrays: the depth-1 candidates of round {bad[0]} (batch position) are not the "
                f"first entries of its pool; expected pool order (depths non-decreasing)"
            )

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
        fl_cache_logprob: np.ndarray | None,
        fl_same_logprob: np.ndarray | None,
        fl_prev_logprob: np.ndarray | None,
        cache_age: int | None,
        prev_tree_root_count: int | None,
    ) -> RoundArrays:
        """One round from 1-D pool arrays [P] and first-level row arrays [n1] (R = 1).

        A retained row that is absent is passed as None (all its entries become
        NaN); so are absent scalars. This is the online decoder's entry point.
        """
        depth = np.asarray(cand_depth, dtype=np.int8)
        n1 = int((depth == 1).sum())

        def row(x: np.ndarray | None) -> np.ndarray:
            if x is None:
                return np.full((1, n1), np.nan, dtype=np.float32)
            return np.asarray(x, dtype=np.float32).reshape(1, -1)

        def scalar(x: float | None, dtype: type) -> np.ndarray:
            return np.array([np.nan if x is None else x], dtype=dtype)

        return cls(
            cand_token=np.asarray(cand_token, dtype=np.int32)[None],
            cand_parent=np.asarray(cand_parent, dtype=np.int32)[None],
            cand_depth=depth[None],
            cand_draft_logprob=np.asarray(cand_draft_logprob, dtype=np.float32)[None],
            cand_expanded=np.asarray(cand_expanded, dtype=bool)[None],
            root_token=np.array([root_token], dtype=np.int32),
            prompt_length=np.array([prompt_length], dtype=np.int32),
            round_index=np.array([round_index], dtype=np.int32),
            tokens_before=np.array([tokens_before], dtype=np.int32),
            prev_accepted=scalar(prev_accepted, np.float32),
            fl_cache_logprob=row(fl_cache_logprob),
            fl_same_logprob=row(fl_same_logprob),
            fl_prev_logprob=row(fl_prev_logprob),
            cache_age=scalar(cache_age, np.float32),
            prev_tree_root_count=scalar(prev_tree_root_count, np.float32),
        )


def _expect_shape(name: str, x: np.ndarray, shape: tuple[int, ...]) -> None:
    if x.shape != shape:
        raise ValueError(f"RoundArrays.{name}: expected shape {shape}, found {x.shape}")
