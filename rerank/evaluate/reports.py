"""The per-run report tables beyond rule values: retained rows, coverage, draw-rule sizes.

`ReportAccumulators` collects them chunk by chunk: fed by the evaluation pass
(`rerank.evaluate.evaluate_traces(consumers=...)`, which builds each chunk's
dense pool and draft ranking once for the rule values and the reports alike),
or by `report_tables`, a pass of its own. Both return DataFrames for the job to
write as CSV and log:

  row_agreement   law x row kind: availability, TV mean/median, argmax agreement (Tables 23, 26)
  row_match       law: token / address match rates, prefixes ending in the continuation (Table 22)
  coverage        law x budget x scored set: exact coverage with interval (Table 21, App. D.10)
  draw_sizes      law x budget: draw-rule tree sizes, top-draw share, matched PEARL (Table 12)
  size_means      law x budget x rule: per-round `size/<rule>@B` means with interval
                  (only when the per-round table has draw rules)
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import pyarrow.dataset as ds

from rerank.evaluate.coverage import COVERAGE_COLUMNS, CoverageRounds
from rerank.evaluate.draw_sizes import DrawSizeSums, size_means
from rerank.evaluate.pool_chunks import PoolChunk, iter_pool_chunks
from rerank.evaluate.row_agreement import ROW_COLUMNS, RowRounds, agreement_tables


class ReportAccumulators:
    """Every report accumulator, fed one `PoolChunk` at a time (a `ChunkConsumer`)."""

    def __init__(self, budgets: Sequence[int], top_ms: Sequence[int] = (100,),
                 frontier_ks: Sequence[int] = (40,)) -> None:  # fmt: skip
        budgets = sorted(set(budgets))
        if not budgets or budgets[0] < 1:
            raise ValueError(f"The 'budgets' must be a non-empty list of ints >= 1. Got {budgets}.")
        self.columns = [*ROW_COLUMNS, *COVERAGE_COLUMNS]
        self.rows = RowRounds()
        self.coverage = CoverageRounds(budgets, list(top_ms), list(frontier_ks))
        self.sizes = DrawSizeSums(budgets)

    def add(self, chunk: PoolChunk) -> None:
        self.merge(self.part(chunk))

    def part(self, chunk: PoolChunk) -> tuple:
        """A chunk's contributions, computed in any thread; `merge` them in chunk order."""
        return self.rows.part(chunk), self.coverage.part(chunk), self.sizes.part(chunk)

    def merge(self, part: tuple) -> None:
        rows, coverage, sizes = part
        self.rows.merge(rows)
        self.coverage.merge(coverage)
        self.sizes.merge(sizes)

    def tables(
        self, per_round: pd.DataFrame | None, n_resamples: int, seed: int
    ) -> dict[str, pd.DataFrame]:
        """The report tables (module doc) of everything added."""
        agreement, match = agreement_tables(self.rows)
        out = {
            "row_agreement": agreement,
            "row_match": match,
            "coverage": self.coverage.table(n_resamples, seed),
            "draw_sizes": self.sizes.table(),
        }
        if per_round is not None and any(c.startswith("size/") for c in per_round.columns):
            out["size_means"] = size_means(per_round, n_resamples, seed)
        return out


def report_tables(
    dataset: ds.Dataset,
    per_round: pd.DataFrame | None,
    budgets: Sequence[int],
    n_resamples: int,
    seed: int,
    chunk_rounds: int = 8192,
    top_ms: Sequence[int] = (100,),
    frontier_ks: Sequence[int] = (40,),
) -> dict[str, pd.DataFrame]:
    """Every report table (module doc) from one chunked pass over the traces of its own."""
    acc = ReportAccumulators(budgets, top_ms, frontier_ks)
    for chunk in iter_pool_chunks(dataset, chunk_rounds, acc.columns):
        acc.add(chunk)
    return acc.tables(per_round, n_resamples, seed)
