"""Adapter from trace rows (trace schema v3) to `RoundArrays`, labels and the candidate table.

Only the columns in `TRACE_COLUMNS` are read. The adapter is the one place
where verification outcomes (target probabilities, root argmax) are touched,
and they go to `first_level_labels` only. The previous round's accepted
length comes from the previous round of the same run (prompt, temperature,
rule, budget) in the same table: trace shards hold whole prompts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from features.first_level import first_level_features, first_level_index, first_level_labels
from features.registry import FEATURES
from features.rounds import (
    FL_ROWS,
    PAD_DEPTH,
    ROW_ARGMAX,
    ROW_SCALARS,
    TOKEN_ONLY_WIDTH,
    RoundArrays,
)
from features.schema import CANDIDATE_SCHEMA
from selection.pool_batch import check_draft_logprobs, trace_matrix
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import TRACE_SCHEMA

CHUNK_ROUNDS = 512  # rounds per call of first_level_features (cache-sized working arrays)
RUN_KEYS = ["prompt_id", "temperature", "rule", "budget"]  # one decoding run of one prompt
TRACE_COLUMNS = [
    *RUN_KEYS,
    "task",
    "round_index",
    "tokens_before",
    "prompt_length",
    "root_token",
    "cand_token",
    "cand_parent",
    "cand_depth",
    "cand_draft_logprob",
    "cand_expanded",
    *FL_ROWS,
    *ROW_SCALARS,
    *ROW_ARGMAX,
    "token_only_argmax",
    "accepted_path",  # of the *previous* round only: its length is prev_accepted
    # labels
    "cand_target_prob",
    "root_argmax",
]
POOL_LISTS = {  # pool list column -> (numpy dtype, padding value)
    "cand_token": (np.int32, -1),
    "cand_parent": (np.int32, -1),
    "cand_depth": (np.int8, PAD_DEPTH),
    "cand_draft_logprob": (np.float32, np.nan),
    "cand_expanded": (np.bool_, False),
    "cand_target_prob": (np.float32, np.nan),
}


def round_arrays(trace: pa.Table) -> RoundArrays:
    """The pre-verification arrays of every round in `trace` (any row order)."""
    check_draft_logprobs(trace.column("cand_draft_logprob"))
    pool = _pool_matrices(trace)
    n1 = (pool["cand_depth"] == 1).sum(axis=1)  # [R]
    return RoundArrays(
        cand_token=pool["cand_token"],
        cand_parent=pool["cand_parent"],
        cand_depth=pool["cand_depth"],
        cand_draft_logprob=pool["cand_draft_logprob"],
        cand_expanded=pool["cand_expanded"],
        root_token=_numpy(trace, "root_token", np.int32),
        prompt_length=_numpy(trace, "prompt_length", np.int32),
        round_index=_numpy(trace, "round_index", np.int32),
        tokens_before=_numpy(trace, "tokens_before", np.int32),
        prev_accepted=previous_accepted(trace),
        token_only_argmax=trace_matrix(trace, "token_only_argmax", -1, np.int32, TOKEN_ONLY_WIDTH)[
            0
        ],
        **{name: _first_level_matrix(trace, name, n1) for name in FL_ROWS},
        **{name: _numpy(trace, name, np.float32) for name in ROW_SCALARS},
        **{name: _numpy_filled(trace, name, -1, np.int32) for name in ROW_ARGMAX},
    )


def candidate_table(trace: pa.Table) -> pa.Table:
    """One candidate-table row per first-level candidate of every round in `trace`."""
    rounds = round_arrays(trace)
    n1 = rounds.n_first_level()
    features = _features_in_chunks(rounds)
    target_prob, _ = trace_matrix(trace, "cand_target_prob", np.nan, np.float32)
    labels = first_level_labels(
        rounds.cand_token, target_prob, _numpy(trace, "root_argmax", np.int32), n1
    )
    round_of, cand_index = first_level_index(n1)
    take = pa.array(round_of)
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "prompt_id": trace.column("prompt_id").take(take),
        "task": trace.column("task").take(take),
        "temperature": trace.column("temperature").take(take),
        "rule": trace.column("rule").take(take),
        "budget": trace.column("budget").take(take),
        "cand_index": pa.array(cand_index.astype(np.int16)),
        "token": pa.array(rounds.cand_token[round_of, cand_index]),
    }
    for name, value in (features | labels).items():
        columns[name] = _to_arrow(value, CANDIDATE_SCHEMA.field(name))
    return pa.table({f.name: columns[f.name] for f in CANDIDATE_SCHEMA}, schema=CANDIDATE_SCHEMA)


def _features_in_chunks(rounds: RoundArrays, names: tuple[str, ...] | None = None
                        ) -> dict[str, np.ndarray]:  # fmt: skip
    """`first_level_features` of every round (`names` of them; None: all), in chunks of
    rounds: the same values (a round's features never depend on the batch), but working arrays
    stay cache-sized, which cuts CPU time by about a third."""
    chunks = range(0, max(rounds.n_rounds, 1), CHUNK_ROUNDS)
    parts = [first_level_features(rounds.rows(a, a + CHUNK_ROUNDS)) for a in chunks]
    names = tuple(parts[0]) if names is None else names
    return {name: np.concatenate([p[name] for p in parts]) for name in names}


MATCHED_FEATURES = tuple(f.name for f in FEATURES if f.group == "matched")
# what next_root_matched reads beyond TRACE_COLUMNS: the root row's summaries
ROOT_ROW_COLUMNS = ("root_entropy", "root_top1_prob")


def next_root_matched(trace: pa.Table) -> dict[str, np.ndarray]:
    """The matched row's features (MATCHED_FEATURES) of every first-level candidate of `trace`,
    in `candidate_table`'s row order, with each round's own root row as its matched row.

    The matched row is the row at the previous round's emitted address (accepted path and
    continuation), which is this round's context: it is this round's root row, computed by
    the previous pass (equal up to rounding, `tests/test_matched_simulated.py`). A recording
    holds it only in the rounds its own scored set covered; a decoder under another policy
    holds it in other rounds (`rerank.evaluate.matched`), where it is this row. Computed by the
    recorder's kernel from the root row's first-level probabilities, entropy, top-1 mass and
    argmax, all at the law temperature as the retained rows are (T = 1 at T = 0).
    """
    rounds = round_arrays(trace)
    n1 = rounds.n_first_level()
    width = rounds.fl_matched_logprob.shape[1]
    target, _ = trace_matrix(trace, "cand_target_prob", np.nan, np.float32, width)
    first = np.arange(width)[None, :] < n1[:, None]
    with np.errstate(divide="ignore"):  # a zero probability is log 0 = -inf, as the row's
        logprob = np.where(first, np.log(target), np.float32(np.nan)).astype(np.float32)
    rounds = dataclasses.replace(
        rounds,
        fl_matched_logprob=logprob,
        matched_entropy=_numpy(trace, "root_entropy", np.float32),
        matched_top1_prob=_numpy(trace, "root_top1_prob", np.float32),
        matched_argmax=_numpy(trace, "root_argmax", np.int32),
    )
    return _features_in_chunks(rounds, MATCHED_FEATURES)


def previous_accepted(trace: pa.Table) -> np.ndarray:
    """[R] float32: accepted length of the previous round of the same run; NaN at round 0.

    Refuses a round whose predecessor is absent or duplicated (a prompt split
    across shards, or two runs mixed under one key), naming the run.
    """
    R = trace.num_rows
    accepted = pc.list_value_length(trace.column("accepted_path")).to_numpy(zero_copy_only=False)
    ri = _numpy(trace, "round_index", np.int64)
    run_codes = [_codes(trace.column(k)) for k in RUN_KEYS]  # each [R]
    order = np.lexsort([ri, *reversed(run_codes)])  # by run, then round index
    same_run = np.ones(max(R - 1, 0), dtype=bool)
    for c in run_codes:
        same_run &= c[order[1:]] == c[order[:-1]]
    step = ri[order[1:]] - ri[order[:-1]]
    if (same_run & (step == 0)).any():
        k = int(np.argmax(same_run & (step == 0)))
        raise SchemaError(
            f"trace: {_run_name(trace, order[k + 1])} has round {ri[order[k + 1]]} twice"
        )
    prev = np.full(R, np.nan, dtype=np.float32)
    linked = same_run & (step == 1)
    prev[order[1:][linked]] = accepted[order[:-1][linked]]
    orphan = (ri > 0) & np.isnan(prev)
    if orphan.any():
        r = int(np.argmax(orphan))
        raise SchemaError(
            f"trace: {_run_name(trace, r)} has round {ri[r]} but not round {ri[r] - 1} in the same "
            "shard; expected whole prompts per shard (prev_accepted needs the previous round)"
        )
    return prev


# -- Arrow -> numpy -------------------------------------------------------------------------


def _pool_matrices(trace: pa.Table) -> dict[str, np.ndarray]:
    """The pool list columns as [R, P] matrices, P = the longest pool (shorter ones padded)."""
    out, lengths = {}, None
    for name, (dtype, fill) in POOL_LISTS.items():
        if name == "cand_target_prob":
            continue  # a label: read separately, never into RoundArrays
        out[name], n = trace_matrix(trace, name, fill, dtype)
        if lengths is None:
            lengths = n
        elif not np.array_equal(n, lengths):
            r = int(np.argmax(n != lengths))
            raise SchemaError(
                f"trace: round {r} of the shard has {n[r]} {name} entries but {lengths[r]} cand_token entries"
            )
    return out


def _first_level_matrix(trace: pa.Table, name: str, n1: np.ndarray) -> np.ndarray:
    """A retained-row column [R, max n1] float32, NaN for nulls; lengths must equal n1."""
    mat, n = trace_matrix(trace, name, np.nan, np.float32, int(n1.max(initial=0)))
    if not np.array_equal(n, n1):
        r = int(np.argmax(n != n1))
        raise SchemaError(
            f"trace: {name} of {_run_name(trace, r)} round {trace.column('round_index')[r]} has {n[r]} "
            f"entries; expected one per first-level candidate ({n1[r]})"
        )
    return mat


def _numpy(trace: pa.Table, name: str, dtype: type) -> np.ndarray:
    """A scalar column as numpy; nulls become NaN where the trace schema allows them (float
    dtypes only), and are refused elsewhere."""
    col = trace.column(name).combine_chunks()
    allowed = TRACE_SCHEMA.field(name).nullable and np.issubdtype(dtype, np.floating)
    if col.null_count and not allowed:
        raise SchemaError(f"trace: column {name} has {col.null_count} nulls; expected none")
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _numpy_filled(trace: pa.Table, name: str, fill: int, dtype: type) -> np.ndarray:
    """An integer column as numpy with nulls (absent rows) as `fill`."""
    col = pc.fill_null(trace.column(name).combine_chunks(), fill)
    return col.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _codes(column: pa.ChunkedArray) -> np.ndarray:
    """[R] integer codes with equal codes for equal values."""
    encoded = pc.dictionary_encode(column.combine_chunks())
    return encoded.indices.to_numpy(zero_copy_only=False)


def _run_name(trace: pa.Table, r: int) -> str:
    keys = ", ".join(f"{k}={trace.column(k)[int(r)].as_py()!r}" for k in RUN_KEYS)
    return f"run ({keys})"


def _to_arrow(value: np.ndarray, field: pa.Field) -> pa.Array:
    """A feature array as its declared Arrow type: NaN -> null (refused on non-null fields)."""
    if value.dtype.kind != "f":
        return pa.array(value, type=field.type)
    missing = np.isnan(value)
    if missing.any() and not field.nullable:
        raise SchemaError(
            f"candidates: column {field.name} is declared non-null but {int(missing.sum())} values are NaN"
        )
    if pa.types.is_integer(field.type):  # integer-valued features carried as float for NaN
        value = np.where(missing, 0, value).astype(field.type.to_pandas_dtype())
    return pa.array(value, type=field.type, mask=missing if missing.any() else None)
