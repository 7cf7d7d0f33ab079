"""Reading logged `rerank.train` runs back from MLflow to compare them.

Pure reading and reshaping of what a run logged — `tables/*.csv`, `plots/*.png`,
params and tags — through the MLflow client; nothing here recomputes a result.
`notebooks/compare_runs.ipynb` is built on these functions, so that no pipeline
logic lives in the notebook.

    runs = find_runs("sqlite:///mlflow.db", experiment="specrank", last=2)
    tables = load_runs(runs, "sqlite:///mlflow.db")      # {"summary": ..., "breakdowns": ...}
    side_by_side(tables["summary"], "gain")              # rules x runs, "+12.3% [+8.1, +16.0]"

Every function works against any tracking URI: the project's SQLite store, or
an `http://` tracking server (artifacts proxied or not).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mlflow
import pandas as pd
from mlflow.entities import Run, RunStatus
from mlflow.exceptions import MlflowException

from rerank.evaluate.recorded import RECORDED
from rerank.fit.models import FEATURE_SETS
from selection.rules import learned, parse_value_key, value_key
from specrank.settings.config import MlflowConfig
from specrank.settings.renames import migrated_params
from specrank.statistics.bootstrap import WEIGHTINGS, fill_notes
from specrank.tracking.train_runs import resolve_tracking_uri

# Tables every `rerank.train` run logs under `tables/` (CSV), and the larger
# per-round / per-candidate tables (Parquet), read only on request.
TABLES = ("summary", "breakdowns", "prediction_quality", "mixture_weights")
PARQUET_TABLES = ("per_round_values", "oof_predictions")
# the acceptance-estimator report's tables (rerank.report.acceptance), logged by runs with rerank.acceptance=true
ACCEPTANCE_TABLES = ("acceptance", "acceptance_reliability")
# A parent run of `rerank.train` carries this tag; its fold child runs carry `fold`.
RUN_TAG = "rerank_model"
# Notebook parameters (papermill is not required: the notebook reads these).
ENV_TRACKING_URI = "SPECRANK_TRACKING_URI"
ENV_EXPERIMENT = "SPECRANK_EXPERIMENT"
ENV_RUN_IDS = "SPECRANK_RUN_IDS"
ENV_LAST = "SPECRANK_LAST"
ENV_WEIGHTING = "SPECRANK_WEIGHTING"
ENV_RULES = "SPECRANK_RULES"
ENV_BUDGETS = "SPECRANK_BUDGETS"


@dataclass(frozen=True)
class RunSelection:
    """Which runs to compare: explicit run ids, else the `last` finished runs of `experiment`."""

    tracking_uri: str
    experiment: str
    run_ids: tuple[str, ...] = ()
    last: int = 2
    weighting: str = "round"
    rules: tuple[str, ...] = ()  # restrict plots to these rules (empty: every rule)
    budgets: tuple[int, ...] = ()  # headline budgets of tables and panels (empty: see below)


def selection_from_env(environ: Mapping[str, str] | None = None) -> RunSelection:
    """The notebook's parameters from `SPECRANK_*` environment variables, checked.

    SPECRANK_TRACKING_URI  default: the project's store (`MlflowConfig().tracking_uri`)
    SPECRANK_EXPERIMENT    default: `MlflowConfig().experiment` ("specrank")
    SPECRANK_RUN_IDS       comma-separated run ids; default: the latest SPECRANK_LAST runs
    SPECRANK_LAST          default 2
    SPECRANK_WEIGHTING     round | prompt | task (default round)
    SPECRANK_RULES         comma-separated rules to plot; default: all
    SPECRANK_BUDGETS       comma-separated headline budgets; default: 8 and 59 where logged
    """
    env = os.environ if environ is None else environ
    defaults = MlflowConfig()

    def items(name: str) -> tuple[str, ...]:
        return tuple(s.strip() for s in env.get(name, "").split(",") if s.strip())

    last_text = env.get(ENV_LAST, "2")
    try:
        last = int(last_text)
    except ValueError as err:
        raise ValueError(f"{ENV_LAST}: expected a positive integer, found {last_text!r}") from err
    if last < 1:
        raise ValueError(f"{ENV_LAST}: expected a positive integer, found {last}")
    budgets = items(ENV_BUDGETS)
    if not all(b.isdigit() for b in budgets):
        raise ValueError(f"{ENV_BUDGETS}: expected comma-separated integers, found {budgets}")
    weighting = env.get(ENV_WEIGHTING, "round")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"{ENV_WEIGHTING}: expected one of {WEIGHTINGS}, found {weighting!r}")
    return RunSelection(
        tracking_uri=resolve_tracking_uri(env.get(ENV_TRACKING_URI) or defaults.tracking_uri),
        experiment=env.get(ENV_EXPERIMENT) or defaults.experiment,
        run_ids=items(ENV_RUN_IDS),
        last=last,
        weighting=weighting,
        rules=items(ENV_RULES),
        budgets=tuple(int(b) for b in budgets),
    )


def client(tracking_uri: str) -> mlflow.MlflowClient:
    """A client for reading; refuses a SQLite store that does not exist (instead of creating one)."""
    uri = resolve_tracking_uri(tracking_uri)
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix) :]).is_file():
        raise FileNotFoundError(
            f"tracking URI {uri}: no such SQLite store; run `make run` (or `python -m "
            f"rerank.train`) first, or point {ENV_TRACKING_URI} at an existing store"
        )
    return mlflow.MlflowClient(tracking_uri=uri)


def _is_train_parent(run: Run) -> bool:
    tags = run.data.tags
    return RUN_TAG in tags and "mlflow.parentRunId" not in tags


def _describe(runs: Sequence[Run]) -> pd.DataFrame:
    rows = []
    for run in runs:
        tags = run.data.tags
        rows.append(
            {
                "run_id": run.info.run_id,
                "run_name": run.info.run_name,
                "experiment_id": run.info.experiment_id,
                "start_time": pd.Timestamp(run.info.start_time, unit="ms", tz="UTC"),
                "status": run.info.status,
                "rerank_model": tags.get(RUN_TAG),
                "git_sha": tags.get("git_sha"),
                "trace_fingerprint": tags.get("trace_fingerprint"),
            }
        )
    frame = pd.DataFrame(rows)
    frame.insert(0, "run", run_labels(frame))
    return frame


def run_labels(frame: pd.DataFrame) -> list[str]:
    """Short unique labels for plots: `<run name> (<model>)`, with the id prefix if needed."""
    base = [
        f"{name or rid[:8]} ({model})"
        for name, rid, model in zip(
            frame["run_name"], frame["run_id"], frame["rerank_model"], strict=True
        )
    ]
    dup = pd.Series(base).duplicated(keep=False).to_numpy()
    return [
        f"{b} {rid[:8]}" if d else b for b, rid, d in zip(base, frame["run_id"], dup, strict=True)
    ]


def find_runs(
    tracking_uri: str,
    experiment: str | None = None,
    run_ids: Sequence[str] = (),
    last: int = 2,
) -> pd.DataFrame:
    """The runs to compare, one row each (label, id, name, start time, model, git SHA, ...).

    With `run_ids`: exactly those runs, in that order (each must be a
    `rerank.train` parent run). Otherwise the `last` most recent finished
    parent runs of `experiment`, oldest first.
    """
    c = client(tracking_uri)
    uri = resolve_tracking_uri(tracking_uri)
    if run_ids:
        runs = []
        for rid in run_ids:
            try:
                run = c.get_run(rid)
            except MlflowException as err:
                raise LookupError(
                    f"{ENV_RUN_IDS}: run {rid!r} not found at tracking URI {uri}: {err.message}"
                ) from err
            if not _is_train_parent(run):
                raise ValueError(
                    f"{ENV_RUN_IDS}: run {rid!r} is not a `rerank.train` parent run (expected tag "
                    f"{RUN_TAG!r} and no parent; found tags {sorted(run.data.tags)})"
                )
            runs.append(run)
        return _describe(runs)
    name = experiment or MlflowConfig().experiment
    exp = c.get_experiment_by_name(name)
    if exp is None:
        found = sorted(e.name for e in c.search_experiments())
        raise LookupError(
            f"{ENV_EXPERIMENT}: experiment {name!r} not found at tracking URI {uri}; "
            f"experiments there: {found}"
        )
    candidates = c.search_runs(
        [exp.experiment_id],
        filter_string=f"attributes.status = '{RunStatus.to_string(RunStatus.FINISHED)}'",
        order_by=["attributes.start_time DESC"],
        max_results=1000,
    )
    parents = [r for r in candidates if _is_train_parent(r)][:last]
    if not parents:
        raise LookupError(
            f"{ENV_EXPERIMENT}: experiment {name!r} at {uri} has no finished `rerank.train` runs "
            f"(runs with tag {RUN_TAG!r} and no parent); run `make run` first"
        )
    return _describe(parents[::-1])


def _download(c: mlflow.MlflowClient, run_id: str, path: str, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    return Path(c.download_artifacts(run_id, path, str(dst)))


def load_run_tables(
    run_id: str,
    tracking_uri: str,
    names: Sequence[str] = TABLES,
    dst: str | Path | None = None,
) -> dict[str, pd.DataFrame]:
    """The run's logged result tables by name (`summary`, `breakdowns`, ...), as DataFrames.

    `names` may include the Parquet tables (`per_round_values`, `oof_predictions`).
    Files are downloaded to `dst` (a new temporary folder if None).
    """
    c = client(tracking_uri)
    logged = {Path(f.path).name for f in c.list_artifacts(run_id, "tables")}
    files = {n: f"{n}.parquet" if n in PARQUET_TABLES else f"{n}.csv" for n in names}
    missing = sorted(f for f in files.values() if f not in logged)
    if missing:
        raise FileNotFoundError(
            f"run {run_id}: expected artifacts {['tables/' + f for f in missing]}, found "
            f"{sorted('tables/' + f for f in logged)} (was it logged by `rerank.train`?)"
        )
    folder = Path(tempfile.mkdtemp(prefix=f"specrank-{run_id[:8]}-") if dst is None else dst)
    out = {}
    for name, file in files.items():
        local = _download(c, run_id, f"tables/{file}", folder)
        out[name] = pd.read_parquet(local) if file.endswith(".parquet") else read_csv_table(local)
    if "breakdowns" in out:
        out["breakdowns"] = long_breakdowns(out["breakdowns"])
    return out


def long_breakdowns(breakdowns: pd.DataFrame) -> pd.DataFrame:
    """The breakdowns as a long table (one row per group, rule and budget); runs logged
    before it was one wrote a wide row per group, a `<rule>@B<b>` column per value."""
    if "rule" in breakdowns.columns:
        return breakdowns
    keys = [c for c in breakdowns.columns if parse_value_key(c) is None]
    long = breakdowns.melt(id_vars=keys, var_name="column", value_name="accepted")
    parsed = [parse_value_key(c) for c in long["column"]]
    long = long.assign(rule=[p[0] for p in parsed], budget=[p[1] for p in parsed])
    return long[[*keys, "rule", "budget", "accepted"]]  # the columns of a long one


def read_csv_table(path: Path | str | IO) -> pd.DataFrame:
    """A logged CSV table as written: an interval's `_note` (empty when it has bounds) stays
    text, where `read_csv` alone would read the empty notes as NaN; the recorded budget
    stays text ("59", or "8,59" for a store mixing recordings)."""
    return fill_notes(pd.read_csv(path, dtype={RECORDED: str}))


def load_results_text(run_id: str, tracking_uri: str, dst: str | Path | None = None) -> str:
    """The printed results table of a run (`tables/results.txt`)."""
    folder = Path(tempfile.mkdtemp(prefix=f"specrank-{run_id[:8]}-") if dst is None else dst)
    return _download(client(tracking_uri), run_id, "tables/results.txt", folder).read_text()


LEARNED = tuple(FEATURE_SETS)  # feature sets of the learned rerankers: `<set>_<model kind>`


def unify_model_rules(name: str, table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Rename a run's learned rules `base_<kind>` / `rows_<kind>` to `base` / `rows`.

    A run fits one model kind, so the renaming is lossless within a run; across
    runs it lines up e.g. `rows_hgb` of one run with `rows_lgbm` of another.
    Applies to rule names in `summary.rule`, `breakdowns.rule`,
    `prediction_quality.predictor`, the acceptance tables' `estimator` and `reference`, and
    the `<rule>@B<b>` / `<rule>` columns of the other tables (and of breakdowns logged before
    they were long).
    """
    names = {learned(s, kind).name: s for s in LEARNED}
    if name in ACCEPTANCE_TABLES:  # the estimators and their reference
        return table.assign(**{c: table[c].replace(names) for c in ("estimator", "reference")
                               if c in table.columns})  # fmt: skip
    if name == "summary" or (name == "breakdowns" and "rule" in table.columns):
        return table.assign(rule=table["rule"].replace(names))
    if name == "prediction_quality":
        return table.assign(predictor=table["predictor"].replace(names))

    def column(c: str) -> str:
        parsed = parse_value_key(c)
        if parsed is None:
            return names.get(c, c)
        return value_key(names.get(parsed[0], parsed[0]), parsed[1])

    return table.rename(columns=column)


def load_runs(
    runs: pd.DataFrame,
    tracking_uri: str,
    names: Sequence[str] = TABLES,
    dst: str | Path | None = None,
    unify_models: bool = True,
) -> dict[str, pd.DataFrame]:
    """`load_run_tables` for every run of `find_runs`, concatenated with a leading `run` column.

    `run` is an ordered categorical in the order of `runs`, so that tables and
    plots keep the runs side by side in a stable order. With `unify_models`,
    the learned rules are named `base` / `rows` whatever the model kind (see
    `unify_model_rules`; the run label names the kind).
    """
    root = Path(tempfile.mkdtemp(prefix="specrank-runs-") if dst is None else dst)
    parts: dict[str, list[pd.DataFrame]] = {n: [] for n in names}
    for label, rid, kind in zip(runs["run"], runs["run_id"], runs["rerank_model"], strict=True):
        for name, table in load_run_tables(rid, tracking_uri, names, root / rid).items():
            if unify_models:
                table = unify_model_rules(name, table, kind)
            # one concat, not `insert`: wide tables (budget sweeps) would fragment
            run = pd.DataFrame({"run": [label] * len(table)}, index=table.index)
            parts[name].append(pd.concat([run, table], axis=1))
    order = pd.CategoricalDtype(list(runs["run"]), ordered=True)
    out = {}
    for name, frames in parts.items():
        table = pd.concat(frames, ignore_index=True)
        table["run"] = table["run"].astype(order)
        out[name] = table
    return out


def download_plots(
    run_id: str, tracking_uri: str, dst: str | Path | None = None
) -> dict[str, Path]:
    """The run's logged PNG figures (`plots/*.png`) by file stem, downloaded locally."""
    c = client(tracking_uri)
    folder = Path(tempfile.mkdtemp(prefix=f"specrank-{run_id[:8]}-") if dst is None else dst)
    out = {}
    for f in c.list_artifacts(run_id, "plots"):
        if f.path.endswith(".png"):
            out[Path(f.path).stem] = _download(c, run_id, f.path, folder)
    return out


def differing_params(runs: pd.DataFrame, tracking_uri: str) -> pd.DataFrame:
    """Logged params (resolved config) whose values differ between the runs: params x runs.
    A run logged before a setting was renamed shows it under the new name."""
    c = client(tracking_uri)
    table = pd.DataFrame(
        {
            label: pd.Series(migrated_params(c.get_run(rid).data.params), dtype=object)
            for label, rid in zip(runs["run"], runs["run_id"], strict=True)
        }
    )
    differs = table.astype(str).nunique(axis=1) > 1
    return table[differs].sort_index()
