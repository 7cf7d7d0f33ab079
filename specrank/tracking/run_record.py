"""A run folder's MLflow record: what a stage logs, written beside its outputs first.

`rerank.train` and `decode.run` write their tables, then `mlflow_run.json` (atomically, the
folder's completion mark: params, tags, metrics, artifacts, child runs), then log that
record. Logging reads only the folder, so when the tracking server is down the outputs
are complete, the failure is named, and

    python -m specrank.tracking.log_run <run folder> [--tracking-uri URI]

logs the same run later. `mlflow_logged.json` then holds the run id, and logging the
folder a second time is refused. Runs carry their host and pid: a run left RUNNING by a
killed process is marked KILLED by the next run logged from that host.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specrank.runtime import faults
from specrank.store.claims import HOST, pid_alive
from specrank.store.files import atomic_write
from specrank.tracking.train_runs import ensure_sqlite_store, parent_run, resolve_tracking_uri

log = logging.getLogger(__name__)
RECORD = "mlflow_run.json"
LOGGED = "mlflow_logged.json"
LOG_LATER = "python -m specrank.tracking.log_run"


@dataclass
class ChildRun:
    run_name: str
    tags: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunRecord:
    """Everything one invocation logs; paths are relative to the run folder."""

    tracking_uri: str
    experiment: str
    run_name: str | None
    config: dict[str, Any]  # the resolved config: params and config/resolved_config.json
    tags: dict[str, str]
    metrics: dict[str, float]
    artifacts: list[tuple[str, str]]  # (file or folder, artifact path); a folder: its files
    children: list[ChildRun] = field(default_factory=list)


class TrackingError(RuntimeError):
    """Logging a finished run failed; its folder is complete and can be logged later."""


def write_record(folder: Path, record: RunRecord) -> Path:
    """The record as the folder's last file (its completion mark), numbers only as metrics."""
    record.metrics = {k: float(v) for k, v in record.metrics.items() if _finite(v)}
    for c in record.children:
        c.metrics = {k: float(v) for k, v in c.metrics.items() if _finite(v)}
    data = json.dumps(asdict(record), indent=1, sort_keys=True, default=str)
    return atomic_write(Path(folder) / RECORD, lambda tmp: tmp.write_text(data))


def _finite(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and abs(float(v)) < float("inf")


def read_record(folder: Path) -> RunRecord:
    path = Path(folder) / RECORD
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder}: no {RECORD}; expected a finished run folder of rerank.train or decode.run "
            f"(the record is written after every table, so a run killed before has none)"
        )
    raw = json.loads(path.read_text())
    raw["artifacts"] = [tuple(a) for a in raw["artifacts"]]
    raw["children"] = [ChildRun(**c) for c in raw["children"]]
    return RunRecord(**raw)


def mark_killed_runs(experiment: str) -> list[str]:
    """Runs of `experiment` left RUNNING by a process of this host that is gone: KILLED."""
    import mlflow  # on first use: importing it costs every entry point about 1.5 s

    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs(
        [exp.experiment_id],
        f"attributes.status = 'RUNNING' and tags.`specrank.host` = '{HOST}'",
    )
    dead = [r.info.run_id for r in runs if not pid_alive(int(r.data.tags.get("specrank.pid", 0)))]
    for run_id in dead:
        client.set_terminated(run_id, "KILLED")
        log.warning("MLflow run %s was left RUNNING by a killed process: marked KILLED", run_id)
    return dead


def log_record(folder: Path, tracking_uri: str | None = None) -> str:
    """Log the run folder's record (to `tracking_uri`, else the one it names); the run id."""
    import mlflow  # on first use: importing it costs every entry point about 1.5 s

    folder = Path(folder)
    logged = folder / LOGGED
    if logged.exists():
        run_id = json.loads(logged.read_text())["run_id"]
        raise ValueError(f"{folder}: already logged as MLflow run {run_id} ({LOGGED})")
    rec = read_record(folder)
    uri = tracking_uri or rec.tracking_uri
    ensure_sqlite_store(resolve_tracking_uri(uri))  # before any client touches it
    mlflow.set_tracking_uri(resolve_tracking_uri(uri))
    mark_killed_runs(rec.experiment)
    tags = rec.tags | {"specrank.host": HOST, "specrank.pid": str(os.getpid()),
                       "specrank.run_folder": str(folder.resolve())}  # fmt: skip
    with parent_run(uri, rec.experiment, rec.run_name, rec.config, tags) as run:
        faults.point("run_logging")
        mlflow.log_metrics(rec.metrics)
        for rel, where in rec.artifacts:
            path = folder / rel
            if path.is_dir():
                mlflow.log_artifacts(str(path), where)
            else:
                mlflow.log_artifact(str(path), where)
        for child in rec.children:
            with mlflow.start_run(run_name=child.run_name, nested=True):
                mlflow.set_tags(child.tags)
                mlflow.log_params(child.params)
                mlflow.log_metrics(child.metrics)
        run_id = run.info.run_id
    atomic_write(logged, lambda tmp: tmp.write_text(json.dumps({"run_id": run_id, "uri": uri})))
    return run_id


def log_or_explain(folder: Path, tracking_uri: str) -> str:
    """`log_record`, and on a tracking failure a `TrackingError` saying how to log it later."""
    import mlflow  # on first use: importing it costs every entry point about 1.5 s

    try:
        return log_record(folder)
    except (mlflow.exceptions.MlflowException, OSError) as err:
        raise TrackingError(
            f"MLflow logging to {tracking_uri} failed ({type(err).__name__}: {err}). The run's "
            f"outputs are complete in {folder}; log them when the tracking store is back with: "
            f"{LOG_LATER} {folder}"
        ) from err
