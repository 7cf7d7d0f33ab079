"""The per-batch quantities every selection rule shares (`selection.values`, `selection.draws`),
computed once per batch of pools."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from torch import Tensor

from selection import fused
from selection.pool_batch import PoolBatch
from selection.ranking import (
    Levels,
    draft_scores,
    first_level_ancestor,
    path_product,
    pool_levels,
    ranking_keys,
    restrict_to_top_m,
)

# A round whose path mass sits on at most this many candidates is valued from their ranks
# alone: greedy rounds (mass on the argmax path, a few nodes deep); sampling rounds have
# mass nearly everywhere.
SPARSE_MASS = 32


@dataclass
class PoolContext:
    """Per-batch quantities every rule shares, computed once. [R, P] unless noted."""

    pool: PoolBatch
    levels: Levels | None  # fast path-reduction layout, None for ragged pools
    law: Tensor  # per-edge target probability under each round's law
    first_ancestor: Tensor  # int64 pool index of the depth-1 ancestor
    draft: Tensor  # cumulative draft log-probability (the draft rule's score)
    valid: Tensor  # bool: in the pool and inside the top-M restriction
    restrict: Tensor | None  # `valid`, or None when every entry is valid (cheaper ranking)
    path_prob: Tensor  # P(u) under the law, 0 outside `valid`

    @cached_property
    def draft_keys(self) -> Tensor:
        """int64 ranking keys of the draft scores (torch route only; see select.ranking_keys)."""
        return ranking_keys(self.draft, self.restrict)

    @cached_property
    def sparse_mass(self) -> tuple[np.ndarray, np.ndarray]:
        """Per round, the candidates that hold path mass when at most SPARSE_MASS do (a
        greedy round's argmax path), and how many (-1: more); compiled route only. Built
        once a batch for every rule's values (`fused.rules_lead_values`)."""
        return fused.sparse_mass_rows(self.path_prob.contiguous().numpy(), SPARSE_MASS)


def pool_context(pool: PoolBatch, top_m: int = 0) -> PoolContext:
    levels = pool_levels(pool.parent, pool.depth)
    law = pool.law_edge_prob()
    draft = draft_scores(pool.draft_logprob, pool.parent, levels)
    valid = restrict_to_top_m(draft, top_m, pool.valid)
    restrict = None if bool(valid.all()) else valid
    path_prob = path_product(law, pool.parent, levels)
    return PoolContext(
        pool=pool,
        levels=levels,
        law=law,
        first_ancestor=first_level_ancestor(pool.parent, levels),
        draft=draft,
        valid=valid,
        restrict=restrict,
        path_prob=path_prob if restrict is None else path_prob * restrict,
    )
