"""MLflow logging of a `rerank.train` invocation (one parent run, a child run per fold).

The tracking store defaults to a SQLite file in the project folder; artifacts
go to `mlartifacts/` beside it (not to a `mlruns/` folder in whatever the
current directory happens to be). Any tracking URI works by config.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specrank.settings.paths import PROJECT_ROOT

if TYPE_CHECKING:
    import mlflow

log = logging.getLogger(__name__)


def resolve_tracking_uri(uri: str) -> str:
    """`sqlite:///relative.db` resolves against the project root; other URIs pass through."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/"):
        return prefix + str(PROJECT_ROOT / uri[len(prefix) :])
    return uri


def ensure_sqlite_store(uri: str) -> None:
    """Create a new SQLite tracking store whole: schema built in a temp file, then renamed.

    MLflow migrates a new SQLite file in many steps (alembic); a process killed between
    them leaves a store every later run fails on ("table _alembic_tmp_experiments already
    exists", found by the fault soak). Built aside and renamed, a kill leaves no store.
    """
    prefix = "sqlite:///"
    if not uri.startswith(prefix) or Path(uri[len(prefix) :]).exists():
        return
    import mlflow  # on first use: importing it costs every entry point about 1.5 s

    path = Path(uri[len(prefix) :])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        mlflow.MlflowClient(tracking_uri=prefix + str(tmp)).search_experiments()  # migrates
        _dispose_engines(str(tmp))
        os.replace(tmp, path)  # a writer racing us built an equal empty store: either wins
    finally:
        tmp.unlink(missing_ok=True)


def _dispose_engines(db_path: str) -> None:
    """Close MLflow's cached engine of a store file before the file is renamed (its pool
    would otherwise keep the temp name's connection open)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    engines = getattr(SqlAlchemyStore, "_engine_map", {})  # absent in other MLflow versions
    for key in [k for k in engines if db_path in str(k)]:
        engines.pop(key).dispose()


def git_sha() -> str:
    """The project's commit, with '-dirty' when the work tree has changes; 'unknown' outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        return f"unknown ({type(err).__name__})"
    return sha + ("-dirty" if dirty else "")


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> flat `a.b.c` params (MLflow params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flatten(value, name + ".")
        else:
            out[name] = str(value)
    return out


PARAM_LIMIT = 6000  # MLflow's limit on one param value (characters)


def loggable_params(config: Mapping[str, Any]) -> dict[str, str]:
    """`flatten(config)` with values past MLflow's limit cut, each cut one logged by name.

    The full values stay in the run's `config/resolved_config.json` artifact.
    """
    params = flatten(config)
    long = sorted(k for k, v in params.items() if len(v) > PARAM_LIMIT)
    if long:
        log.warning(
            "MLflow params cut to %d characters: %s (full values in config/resolved_config.json)",
            PARAM_LIMIT,
            long,
        )
    return {k: v[:PARAM_LIMIT] for k, v in params.items()}


@contextmanager
def parent_run(
    tracking_uri: str,
    experiment: str,
    run_name: str | None,
    config: Mapping[str, Any],
    tags: Mapping[str, str],
) -> Iterator[mlflow.ActiveRun]:
    """Start the invocation's parent run with the resolved config as params and artifact."""
    import mlflow  # on first use: importing it costs every entry point about 1.5 s

    uri = resolve_tracking_uri(tracking_uri)
    ensure_sqlite_store(uri)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(experiment) is None:
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
        mlflow.create_experiment(experiment, artifact_location=artifacts)
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params(loggable_params(config))
        mlflow.log_dict(dict(config), "config/resolved_config.json")
        mlflow.set_tags({"git_sha": git_sha(), **tags})
        yield run


def metric_key(*parts: object) -> str:
    """Namespaced metric name, e.g. `gain/B59/rows_hgb` (only MLflow-safe characters)."""
    key = "/".join(str(p) for p in parts)
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in key)
