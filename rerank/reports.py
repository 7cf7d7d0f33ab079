"""The issue-14 report tables of a run: retained rows, coverage, draw-rule sizes.

`report_tables` reads the trace store once (every accumulator shares each
chunk's dense pool and draft ranking) and returns DataFrames for the job to
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

from rerank.coverage import COVERAGE_COLUMNS, CoverageRounds
from rerank.draw_sizes import DrawSizeSums, size_means
from rerank.pool_chunks import iter_pool_chunks
from rerank.row_agreement import ROW_COLUMNS, RowRounds, agreement_tables


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
    """Every report table (module doc) from one chunked pass over the traces."""
    budgets = sorted(set(budgets))
    if not budgets or budgets[0] < 1:
        raise ValueError(f"The 'budgets' must be a non-empty list of ints >= 1. Got {budgets}.")
    rows, coverage = RowRounds(), CoverageRounds(budgets, list(top_ms), list(frontier_ks))
    sizes = DrawSizeSums(budgets)
    for chunk in iter_pool_chunks(dataset, chunk_rounds, [*ROW_COLUMNS, *COVERAGE_COLUMNS]):
        rows.add(chunk)
        coverage.add(chunk)
        sizes.add(chunk)
    agreement, match = agreement_tables(rows)
    out = {
        "row_agreement": agreement,
        "row_match": match,
        "coverage": coverage.table(n_resamples, seed),
        "draw_sizes": sizes.table(),
    }
    if per_round is not None and any(c.startswith("size/") for c in per_round.columns):
        out["size_means"] = size_means(per_round, n_resamples, seed)
    return out
