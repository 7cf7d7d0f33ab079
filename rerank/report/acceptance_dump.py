"""The calibration dump: every first-level candidate's acceptance estimates and labels, as a
declared Parquet table (`acceptance_dump.parquet`) a user can take into their own engine.

One row per prompt, round and first-level candidate of the report (held-out rows only),
in the recording's order within each law. `docs/acceptance.md` documents every column.
Estimator columns are null where the run has no such estimator (a feature set it did not
fit, the controls and the training-half vLLM fits under `rerank.transfer`, a `*_top`
column off the drafter's top candidate, `dspark_confidence_top` where the drafter records
no confidence); every other column is never null.
Change a column and bump `DUMP_VERSION`; `read_dump` refuses other versions but the
declared migrations (`DUMP_MIGRATIONS`: v1, before `dspark_confidence_top`, reads as v2 with
it null).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from rerank.fit.models import FEATURE_SETS
from rerank.report.acceptance import DSPARK, VLLM_FITTED, VLLM_ONLINE, LawSet, law_label
from rerank.report.acceptance_plots import root_entropy_halves, text_values
from rerank.report.acceptance_vllm import VLLM_SOURCE, logit_q_feature, margin_feature
from selection.rules import learned
from specrank.statistics.laws import law_name
from specrank.store.files import atomic_write
from specrank.store.tables import Migration, SchemaError, TableSpec, check_columns, check_nulls

DUMP_VERSION = 2
_f32, _f64, _i32 = pa.float32(), pa.float64(), pa.int32()
_COLUMNS = {  # name -> type; never null
    "prompt_id": pa.string(), "task": pa.string(), "law": pa.string(),
    "temperature": _f32, "rule": pa.string(), "budget": _i32, "round_index": _i32,
    "recording_order": pa.int64(), "cand_index": pa.int16(), "token": _i32,
    "fold": pa.int8(), "draft_rank": _i32, "is_top": pa.bool_(),
    "logit_q": _f64, "top2_margin": _f64, "root_entropy": _f32, "entropy_half": pa.string(),
    "event": pa.bool_(), "p_exact": _f64, "label_is_argmax": pa.bool_(), "draft_prob": _f64,
}  # fmt: skip
CONTROLS = ("rank_control", "iso_q1")
ESTIMATOR_COLUMNS = [
    *(f"reranker_{fs}" for fs in FEATURE_SETS), *CONTROLS,
    *(f"{v}_{s}" for v in (*VLLM_FITTED, VLLM_ONLINE) for s in ("top", "all")),
    f"{DSPARK}_top",  # v2: the drafter's recorded confidence, its top candidate only
]  # fmt: skip
TOP_ONLY = (DSPARK,)  # estimators of the `top` set alone: one `_top` column
DUMP_SCHEMA = pa.schema(
    [*(pa.field(n, t, nullable=False) for n, t in _COLUMNS.items()),
     *(pa.field(n, _f64, nullable=True) for n in ESTIMATOR_COLUMNS)]
)  # fmt: skip
DUMP_MIGRATIONS = (Migration(1, (f"{DSPARK}_top",)),)
DUMP_SPEC = TableSpec(name="acceptance_dump", version=DUMP_VERSION, schema=DUMP_SCHEMA,
                      migrations=DUMP_MIGRATIONS)  # fmt: skip


def _base_columns(part: pd.DataFrame) -> dict[str, np.ndarray]:
    """Every never-null column of the dump, from the report's rows."""
    text = {k: text_values(part[k]) for k in ("prompt_id", "task", "rule")}
    same = ("temperature", "budget", "round_index", "cand_index", "token", "fold", "draft_rank",
            "root_entropy")  # fmt: skip
    return (
        text
        | {k: part[k].to_numpy() for k in same}
        | {
            "law": _law_names(part["temperature"].to_numpy()),
            "recording_order": part["order"].to_numpy(),
            "is_top": part["draft_rank"].to_numpy() == 0,
            "logit_q": logit_q_feature(part["draft_prob"].to_numpy()),
            "top2_margin": margin_feature(part["margin_top_sibling"].to_numpy()),
            "entropy_half": root_entropy_halves(part),
            "event": part["event"].to_numpy(bool),
            "p_exact": _exact(part),
            "label_is_argmax": part["label_is_argmax"].to_numpy(bool),
            "draft_prob": part["draft_prob"].to_numpy(np.float64),
        }
    )


def dump_table(frame: pd.DataFrame, sets: Sequence[LawSet], fitted: Mapping[str, str],
               rerank_model: str, reference: str) -> pa.Table:  # fmt: skip
    """The dump of the report's rows. `fitted`: dump column (`reranker_<set>`, a control) ->
    the frame's prediction column of the run; `reference`: the report's reference
    estimator (kept in the file's metadata, as the model kind and vLLM's source are)."""
    rows = np.concatenate([ls.rows for ls in sets if ls.candidates == "all"])
    part = frame.iloc[rows]
    out = _base_columns(part)
    for name in ESTIMATOR_COLUMNS:
        out[name] = (part[fitted[name]].to_numpy(np.float64) if name in fitted
                     else np.full(rows.size, np.nan))  # fmt: skip
    position = pd.Series(np.arange(rows.size), index=rows)
    for ls in sets:
        at = position.loc[ls.rows].to_numpy()
        for est in (*VLLM_FITTED, VLLM_ONLINE, *TOP_ONLY):
            if est in ls.preds:
                out[f"{est}_{ls.candidates}"][at] = ls.preds[est]
    table = pa.table({n: _column(out[n], DUMP_SCHEMA.field(n)) for n in DUMP_SCHEMA.names})
    table = DUMP_SPEC.conform(table)
    meta = {**table.schema.metadata, b"specrank.rerank_model": rerank_model.encode(),
            b"specrank.vllm_source": VLLM_SOURCE.encode(),
            b"specrank.reference": reference.encode()}  # fmt: skip
    return table.replace_schema_metadata(meta)


def _law_names(temps: np.ndarray) -> np.ndarray:
    distinct, code = np.unique(temps, return_inverse=True)
    return np.array([law_name(float(t)) for t in distinct], dtype=object)[code]


def _exact(part: pd.DataFrame) -> np.ndarray:
    out = np.empty(len(part))
    temps = part["temperature"].to_numpy()
    for t in np.unique(temps):
        at = temps == t
        out[at] = law_label(part[at], float(t))
    return out


def _column(values, field: pa.Field) -> pa.Array:
    """An Arrow column of the field's type; NaN is null only where the field may be null."""
    arr = np.asarray(values)
    if field.nullable and arr.dtype.kind == "f":
        return pa.array(arr, type=field.type, mask=np.isnan(arr))
    return pa.array(list(arr) if arr.dtype == object else arr, type=field.type)


def write_dump(path: Path, table: pa.Table) -> None:
    """Written whole or not at all."""
    atomic_write(Path(path), lambda tmp: pq.write_table(table, tmp))


def read_dump(path: Path | str) -> pa.Table:
    """A dump read back, checked: its table name and version, every column, the nulls. A
    version `DUMP_MIGRATIONS` declares reads as this one, the columns it lacks null."""
    table = pq.read_table(path)
    meta = table.schema.metadata or {}
    name, version = meta.get(b"specrank.table", b"").decode(), meta.get(b"specrank.version", b"")
    found = int(version) if version.isdigit() else None
    migration = DUMP_SPEC.migration(found)
    if name != DUMP_SPEC.name or (found != DUMP_VERSION and migration is None):
        raise SchemaError(f"{path}: expected an {DUMP_SPEC.name} table v{DUMP_VERSION}, found "
                          f"{name or 'no name'} v{version.decode() or '?'}")  # fmt: skip
    absent = migration.added if migration is not None else ()
    check_columns(DUMP_SPEC, table.column_names, absent)
    if absent:  # the older version's table as this one: its added columns null, in place
        cols = {n: table[n] if n in table.column_names
                else pa.nulls(len(table), DUMP_SCHEMA.field(n).type) for n in DUMP_SCHEMA.names}  # fmt: skip
        table = pa.table(cols, schema=DUMP_SCHEMA.with_metadata(
            {**meta, b"specrank.version": str(DUMP_VERSION).encode()}))  # fmt: skip
    check_nulls(DUMP_SPEC, table)
    if table.schema.remove_metadata() != DUMP_SCHEMA.remove_metadata():
        raise SchemaError(f"{path}: the column types differ from {DUMP_SPEC.name} v{DUMP_VERSION}")
    return table


def dump_sets(table: pa.Table) -> tuple[pd.DataFrame, list[LawSet], str]:
    """A dump read back as the report's rows, law sets and reference: what
    `rerank.report.acceptance.acceptance_table` takes, so a saved run's figures are
    recomputed from its dump alone (`bench.bench_acceptance`)."""
    meta = table.schema.metadata or {}
    kind = meta.get(b"specrank.rerank_model", b"").decode()
    reference = meta.get(b"specrank.reference", b"").decode()
    d = table.to_pandas()
    frame = d.rename(columns={"recording_order": "order", "p_exact": "label_target_prob"})
    names = {f"reranker_{fs}": learned(fs, kind).name for fs in FEATURE_SETS} | {
        c: c for c in CONTROLS}  # fmt: skip
    present = [c for c in names if d[c].notna().any()]
    sets = []
    temps = d["temperature"].to_numpy()
    for t in np.unique(temps):
        law_rows = np.flatnonzero(temps == t)
        for cands in ("top", "all"):
            rows = law_rows if cands == "all" else law_rows[d["is_top"].to_numpy()[law_rows]]
            part = d.iloc[rows]
            preds = {"draft_prob": part["draft_prob"].to_numpy()} | {
                names[c]: part[c].to_numpy() for c in present}  # fmt: skip
            for est in (VLLM_ONLINE, *VLLM_FITTED, *(TOP_ONLY if cands == "top" else ())):
                values = part[f"{est}_{cands}"].to_numpy()
                if not np.isnan(values).all():
                    preds[est] = values
            sets.append(LawSet(float(t), cands, rows, preds))
    return frame, sets, reference
