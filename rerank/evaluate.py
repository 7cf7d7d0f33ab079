"""Evaluate every selection rule on the same recorded pools (SPEC §6, issue 6).

Streams a trace store in chunks of rounds; for each chunk it builds the dense
pools, turns every first-factor source into candidate scores and asks
`decode.select.values` for the value of each rule at each budget. The result is a
per-round table (keys, breakdown fields, `<rule>@B<b>` values) from which
`rerank.summary` computes gains and intervals.

First-factor sources (each replaces log q(x1) in the draft score):
  learned   out-of-fold predictions phat (rerankers, isotonic q1) joined by key
  sub_<row> direct substitution of a retained row's log-probability
  mix_<row>_w<w>  (1-w) log q(x1) + w log r(x1), for each candidate weight
A retained row that is absent in a round leaves that round's draft factor in
place: the rule then ranks exactly like draft selection there (SPEC §7: rows
are missing, never zero).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import torch
from torch import Tensor

from calibrate.isotonic import PROB_FLOOR
from decode.select.pool_batch import POOL_COLUMNS, PoolBatch, list_matrix, pool_batch_from_table
from decode.select.ranking import leading_factor_edges, path_sum, pool_levels
from decode.select.values import RULES, evaluate_pools

ROUND_KEYS = ["prompt_id", "temperature", "rule", "budget", "round_index"]
RETAINED_ROWS = {"cache": "fl_cache_logprob", "same": "fl_same_logprob", "prev": "fl_prev_logprob"}
TRACE_COLUMNS = sorted(
    set(POOL_COLUMNS) | set(ROUND_KEYS) | set(RETAINED_ROWS.values()) | {"category"}
)


@dataclass
class PromptCurves:
    """Per-(temperature, prompt) sums over rounds of per-budget curves.

    `pearl` and `size/pearl` (PEARL's value and tree size at each pre-draw
    budget) find the matched-size PEARL budget, `draft` (draft selection's
    value at each budget) the node-equivalent budgets, in any bootstrap
    resample without keeping a [rounds, pool] curve per round.
    """

    sums: dict[str, dict[tuple[float, str], np.ndarray]] = field(default_factory=dict)

    def add(
        self, temperature: np.ndarray, prompt_id: np.ndarray, curves: dict[str, Tensor]
    ) -> None:
        """Add a chunk's `curve/<name>` tensors ([R, P]) to the per-prompt sums."""
        keys = pd.MultiIndex.from_arrays([temperature.astype(np.float64), prompt_id])
        for name, curve in curves.items():
            store = self.sums.setdefault(name, {})
            sums = pd.DataFrame(curve.double().numpy()).groupby(keys).sum()
            for key, row in zip(sums.index, sums.to_numpy(), strict=True):
                if key in store and store[key].shape != row.shape:
                    raise ValueError(f"pools of different sizes within prompt {key[1]!r}")
                store[key] = store.get(key, 0.0) + row

    def array(self, name: str, temperature: float, prompts: np.ndarray) -> np.ndarray:
        """[n_prompts, P] sums of curve `name` in the order of `prompts`."""
        store, t = self.sums[name], float(temperature)
        return np.stack([store[(t, p)] for p in prompts])


@dataclass
class EvalPlan:
    """What to evaluate on each chunk of rounds."""

    budgets: list[int]
    rules: list[str] = field(default_factory=lambda: list(RULES))
    substitutions: list[str] = field(default_factory=lambda: list(RETAINED_ROWS))
    mixture_weights: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    top_m: int = 0
    curve_rules: list[str] = field(default_factory=list)  # value curves (rule budgets)


def first_level_matrix(values: pa.ChunkedArray | pa.Array, width: int) -> np.ndarray:
    """[R, width] float32 from a list column over first-level candidates; NaN where null/absent."""
    return list_matrix(values, np.nan, np.float32, width)[0]


def _first_factor_scores(pool: PoolBatch, levels, first_logprob: Tensor) -> Tensor:
    """Scores with the depth-1 factor replaced wherever `first_logprob` is not NaN. [R, P]."""
    edge = leading_factor_edges(pool.draft_logprob, first_logprob, pool.depth, 1, levels)
    return path_sum(edge, pool.parent, levels)


@dataclass
class LearnedFactors:
    """Out-of-fold log phat of each learned rule, as dense first-level matrices by round.

    Built once from the predictions table, then looked up per chunk by round
    keys (a hash index): joining the whole table to every chunk instead cost
    minutes at paper scale.
    """

    rounds: pd.MultiIndex  # unique ROUND_KEYS, one per row of the matrices
    log_phat: dict[str, np.ndarray]  # name -> [n_rounds, n_first] float32, NaN where absent

    @classmethod
    def from_predictions(cls, preds: pd.DataFrame, names: Sequence[str]) -> LearnedFactors:
        codes, rounds = pd.MultiIndex.from_frame(preds[ROUND_KEYS]).factorize()
        cand = preds["cand_index"].to_numpy(np.int64)
        n_first = int(cand.max()) + 1 if len(cand) else 0
        log_phat = {}
        for name in names:
            mat = np.full((len(rounds), n_first), np.nan, dtype=np.float32)
            mat[codes, cand] = np.log(np.clip(preds[name].to_numpy(np.float64), PROB_FLOOR, 1.0))
            log_phat[name] = mat
        return cls(rounds, log_phat)

    def rows(self, keys: pd.DataFrame) -> np.ndarray:
        """Matrix row of each of a chunk's rounds (-1: no predictions for it)."""
        return self.rounds.get_indexer(pd.MultiIndex.from_frame(keys[ROUND_KEYS]))

    def matrix(self, row: np.ndarray, name: str, width: int) -> Tensor:
        """Dense [R, width] log phat for the rounds at `row` (NaN where a round has none)."""
        mat = self.log_phat[name]
        if mat.shape[1] > width:
            raise ValueError(
                f"predictions '{name}' name first-level candidate {mat.shape[1] - 1}, but the "
                f"pools hold {width} candidates: the predictions come from other traces"
            )
        out = np.full((len(row), width), np.nan, dtype=np.float32)
        found = row >= 0
        out[found, : mat.shape[1]] = mat[row[found]]
        return torch.from_numpy(out)


def _scores_for_chunk(
    pool: PoolBatch,
    table: pa.Table,
    keys: pd.DataFrame,
    plan: EvalPlan,
    learned: LearnedFactors | None,
    extra_factor: Callable[[PoolBatch, pa.Table], dict[str, Tensor]] | None,
) -> dict[str, Tensor]:
    width = pool.shape[1]
    levels = pool_levels(pool.parent, pool.depth)
    scores: dict[str, Tensor] = {}
    row = learned.rows(keys) if learned else None
    for name in learned.log_phat if learned else ():
        log_phat = learned.matrix(row, name, width)
        missing = torch.isnan(log_phat) & (pool.depth == 1)
        if missing.any():
            rows = torch.nonzero(missing.any(1)).flatten()[:3].tolist()
            raise ValueError(
                f"predictions '{name}' lack first-level candidates of {int(missing.any(1).sum())} "
                f"rounds (e.g. {keys.iloc[rows].to_dict('records')}); every round needs a prediction"
            )
        scores[name] = _first_factor_scores(pool, levels, log_phat)
    draft_first = pool.draft_logprob
    for row in plan.substitutions:
        r = torch.from_numpy(first_level_matrix(table[RETAINED_ROWS[row]], width))
        # A row is absent when all its entries are null (NaN: keep the draft factor);
        # a null entry of a present row is a zeroed probability (the preceding
        # row's continuation token, SPEC §5): log 0 = -inf.
        present = ~torch.isnan(r).all(dim=-1, keepdim=True)
        r = torch.where(present & torch.isnan(r), -torch.inf, r)
        scores[f"sub_{row}"] = _first_factor_scores(pool, levels, r)
        for w in plan.mixture_weights:
            mix = (1 - w) * draft_first + w * r  # nan where the row is absent -> draft factor
            scores[f"mix_{row}_w{w:g}"] = _first_factor_scores(pool, levels, mix)
    if extra_factor is not None:
        scores.update(extra_factor(pool, table))
    return scores


def _round_fields(table: pa.Table, pool: PoolBatch) -> pd.DataFrame:
    """Keys and breakdown fields of each round of the chunk."""
    frame = table.select(
        [*ROUND_KEYS, "task", "category", "root_entropy", "root_argmax"]
    ).to_pandas()
    # the drafter's top first token (draft rank 0 among depth-1 candidates) vs the target's argmax
    first_draft = torch.where(pool.depth == 1, pool.draft_logprob, -torch.inf)
    top = torch.argmax(first_draft, dim=-1)  # ties -> lowest pool index, the SPEC tie-break
    frame["draft_top_is_argmax"] = (
        torch.gather(pool.token, -1, top[:, None])[:, 0].numpy() == frame["root_argmax"].to_numpy()
    )
    return frame.drop(columns=["root_argmax"])


def iter_trace_chunks(
    dataset: ds.Dataset, chunk_rounds: int, columns: Sequence[str] = TRACE_COLUMNS
) -> Iterator[pa.Table]:
    """The trace store `chunk_rounds` rounds at a time, reading only `columns`."""
    for batch in dataset.to_batches(columns=list(columns), batch_size=chunk_rounds):
        if batch.num_rows:
            yield pa.Table.from_batches([batch])


def evaluate_traces(
    dataset: ds.Dataset,
    plan: EvalPlan,
    predictions: pd.DataFrame | None = None,
    learned: Sequence[str] = (),
    extra_factor: Callable[[PoolBatch, pa.Table], dict[str, Tensor]] | None = None,
    chunk_rounds: int = 8192,
    curves: PromptCurves | None = None,
) -> pd.DataFrame:
    """One row per round: keys, task, root entropy, first-token match, `<rule>@B<b>` values.

    `predictions` holds ROUND_KEYS + `cand_index` + one probability column per
    name in `learned` (out-of-fold). `extra_factor(pool, table)` may add rules
    given as full candidate scores (e.g. per-depth calibration). `curves`, when
    given, collects per-prompt curves: PEARL's for the matched-size variant,
    draft's for node-equivalent budgets.
    """
    if learned and predictions is None:
        raise ValueError(f"learned rules {list(learned)} need a predictions table")
    factors = LearnedFactors.from_predictions(predictions, learned) if learned else None
    parts = []
    for table in iter_trace_chunks(dataset, chunk_rounds):
        pool = pool_batch_from_table(table)
        keys = table.select(ROUND_KEYS).to_pandas()
        scores = _scores_for_chunk(pool, table, keys, plan, factors, extra_factor)
        values = evaluate_pools(
            pool,
            plan.budgets,
            plan.rules,
            plan.top_m,
            extra_scores=scores,
            curves=curves is not None,
            curve_rules=plan.curve_rules,
        )
        if curves is not None:
            names = [n for n in values if n.startswith("curve/")]
            curves.add(
                table["temperature"].to_numpy(),
                table["prompt_id"].to_numpy(zero_copy_only=False),
                {n.removeprefix("curve/"): values.pop(n) for n in names},
            )
        frame = _round_fields(table, pool)
        cols = {}
        for name, v in values.items():
            for j, b in enumerate(plan.budgets):
                cols[f"{name}@B{b}"] = v[:, j].double().numpy()
        parts.append(pd.concat([frame, pd.DataFrame(cols)], axis=1))
    if not parts:
        raise ValueError("the trace store holds no rounds")
    return pd.concat(parts, ignore_index=True)
