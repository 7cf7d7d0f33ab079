"""The matched row under a policy that scores beyond the tree (`top_m`, `frontier`, `pool`),
where it follows the rule's own trees rather than the recording's.

Round t holds the matched row when round t-1's pass scored its emitted address, i.e. when
round t-1 was covered by the policy's set Q of the tree it verified (paper Eq. 5). That tree
is the rule's own, and the rule's ranking at t-1 read whether t-1 held the row: so a learned
rule reading the row is simulated round by round, like App. D.10's decoder without a root
pass (`rerank.evaluate.policy`), with its two rankings in place of root's and draft's:

    h_0 = 0,   h_t+1 = h_t cov(T_with,t) + (1 - h_t) cov(T_without,t)
    V_t = h_t V(T_with,t) + (1 - h_t) V(T_without,t)

T_with ranks by the rule's phat with the row (its features from the round's root row, which
the matched row is: `features.from_trace.next_root_matched`), T_without by its phat without
(every matched feature missing). Token-only rows are never simulated: their content depends
on every prefix a pass scores and the trace keeps them aggregated, so a decoder under these
policies keeps none (`selection.policies.NO_TOKEN_ONLY`), offline and online.

Fitting cannot follow the rule's own trees (the rule is being fitted), so a model is fitted
on the availability that draft selection's trees give at the first evaluated budget: round t
holds the row when draft's tree at t-1 was covered; at T > 0, with the probability of that
coverage, drawn once per round from a seeded hash of its keys (`NextRootRows.held`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.dataset as ds

from features.first_level import first_level_index
from features.from_trace import MATCHED_FEATURES, ROOT_ROW_COLUMNS, TRACE_COLUMNS, next_root_matched
from features.registry import set_features
from rerank.evaluate.policy import own_tree_coverage
from rerank.evaluate.pool_chunks import ROUND_KEYS, PoolChunk, RoundCodes, chunk_of, predecessors
from selection.policies import SIMULATED
from selection.pool_batch import POOL_COLUMNS
from specrank.settings.errors import Refusal

VARIANTS = ("fit", "with", "without")  # availability: draft's trees / always / never
_KEYS = [*ROUND_KEYS, "cand_index"]


def simulated_sets(feature_sets: Sequence[str], policy: str) -> list[str]:
    """Of `feature_sets`, those reading the matched row when `policy` is SIMULATED."""
    if policy not in SIMULATED:
        return []
    return [fs for fs in feature_sets if set(MATCHED_FEATURES) & set(set_features(fs))]


@dataclass
class SimulatedPredictions:
    """The held-out phat of a simulated set's cross-fitted models with the matched row and
    without (`with/<rule>`, `without/<rule>`), which the evaluation ranks by."""

    sets: Sequence[str]
    # (temperature, variant) -> that law's candidate rows as `law_frame` gives them
    frame: Callable[[float, str], pd.DataFrame]

    def add_to(self, out: pd.DataFrame, rule: str, feature_set: str, models: Sequence[Any],
               fold: np.ndarray, temperature: float) -> None:  # fmt: skip
        """`with/<rule>` and `without/<rule>` columns of a law's predictions `out`, when
        `feature_set` is one of `sets`."""
        if feature_set in self.sets:
            for variant in ("with", "without"):
                out[f"{variant}/{rule}"] = self.phat(models, fold, temperature, variant)

    def phat(self, models: Sequence[Any], fold: np.ndarray, temperature: float,
             variant: str) -> np.ndarray:  # fmt: skip
        """[n rows] phat of the law's rows in `variant`, each by the model that did not see its
        prompt: models[f] was fitted on the other half and predicts the rows of fold f."""
        frame = self.frame(temperature, variant)
        out = np.full(len(frame), np.nan)
        for f, model in enumerate(models):
            rows = np.flatnonzero(fold == f)
            out[rows] = model.predict_phat(frame.iloc[rows])
        return out


@dataclass
class NextRootRows:
    """Per first-level candidate of a trace store: the matched features with the round's root
    row as the matched row, and whether a decoder selecting with draft's trees holds it."""

    codes: RoundCodes
    rows: pd.Index  # round code * width + cand_index of each row (unique)
    width: int  # first-level columns of the codes
    values: dict[str, np.ndarray]  # MATCHED_FEATURES -> [n rows] float32
    held: np.ndarray  # [n rows] bool

    def positions(self, frame: pd.DataFrame) -> np.ndarray:
        """Row of each of `frame`'s candidates (ROUND_KEYS + cand_index); refuses any not here."""
        code = self.codes.encode(frame[ROUND_KEYS])
        cand = frame["cand_index"].to_numpy(np.int64)
        pos = self.rows.get_indexer(np.where(code >= 0, code * self.width + cand, -1))
        if (pos < 0).any():
            raise Refusal(
                f"{int((pos < 0).sum())} candidate rows are not in the traces the matched row was "
                f"simulated from (e.g. {frame.iloc[int(np.argmax(pos < 0))][_KEYS].to_dict()}): "
                f"the candidate table (rerank.features) must come from rerank.traces"
            )
        return pos

    def matched(self, frame: pd.DataFrame, variant: str) -> dict[str, np.ndarray]:
        """The matched features of `frame`'s rows in `variant` (VARIANTS), missing where the
        row is not held, in each column's own dtype."""
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
        names = [c for c in MATCHED_FEATURES if c in frame.columns]
        if variant == "without":
            return {c: np.full(len(frame), np.nan, frame[c].dtype) for c in names}
        pos = self.positions(frame)
        held = self.held[pos] if variant == "fit" else np.ones(len(pos), dtype=bool)
        return {c: np.where(held, self.values[c][pos], np.nan).astype(frame[c].dtype)
                for c in names}  # fmt: skip


def next_root_rows(dataset: ds.Dataset, policy: str, top_m: int, budget: int, seed: int
                   ) -> NextRootRows:  # fmt: skip
    """`NextRootRows` of a trace store, a shard at a time (shards hold whole prompts, and a
    round's availability reads its predecessor). `budget`: the size of draft's trees."""
    if policy not in SIMULATED:
        raise ValueError(f"the matched row is simulated under {SIMULATED}; got {policy!r}")
    columns = sorted({*TRACE_COLUMNS, *ROOT_ROW_COLUMNS, *POOL_COLUMNS, *ROUND_KEYS, "cand_scored"})
    keys, values, held = [], {c: [] for c in MATCHED_FEATURES}, []
    for fragment in dataset.get_fragments():
        table = fragment.to_table(columns=columns)
        if not table.num_rows:
            continue
        for c, v in next_root_matched(table).items():
            values[c].append(v)
        chunk = chunk_of(table)
        cov = draft_coverage(chunk, policy, top_m, budget)
        round_held = held_after(chunk.keys[ROUND_KEYS], cov, seed)
        n1 = (chunk.pool.depth == 1).sum(-1).numpy()
        round_of, cand = first_level_index(n1)
        part = chunk.keys[ROUND_KEYS].iloc[round_of].reset_index(drop=True)
        part["cand_index"] = cand
        keys.append(part)
        held.append(round_held[round_of])
    if not keys:
        raise ValueError("the trace store holds no rounds")
    frame = pd.concat(keys, ignore_index=True)
    codes = RoundCodes(frame[ROUND_KEYS])
    width = int(frame["cand_index"].max()) + 1
    rows = pd.Index(codes.encode(frame[ROUND_KEYS]) * width + frame["cand_index"].to_numpy())
    if not rows.is_unique:
        raise ValueError("the trace store holds a round twice")
    return NextRootRows(codes, rows, width, {c: np.concatenate(v) for c, v in values.items()},
                        np.concatenate(held))  # fmt: skip


def draft_coverage(chunk: PoolChunk, policy: str, top_m: int, budget: int) -> np.ndarray:
    """[R] float64: the probability that draft's tree of `budget` nodes is covered under
    `policy` (`rerank.evaluate.policy.own_tree_coverage`)."""
    return own_tree_coverage(chunk.ctx, chunk.order, budget, policy, top_m, chunk.scored)[0].numpy()


def held_after(keys: pd.DataFrame, cov: np.ndarray, seed: int) -> np.ndarray:
    """[R] bool: whether each round holds the row, its predecessor (same run, previous round
    index) having been covered with probability `cov`: at T = 0 cov is 0 or 1; at T > 0 a
    uniform draw from a seeded hash of the round's keys decides, the same in every run."""
    prev = predecessors(keys)
    u = pd.util.hash_pandas_object(keys[ROUND_KEYS].astype(str), index=False,
                                   hash_key=f"{seed:016d}"[-16:]).to_numpy()  # fmt: skip
    u = (u >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    p = np.where(prev >= 0, cov[np.maximum(prev, 0)], 0.0)
    return u < p
