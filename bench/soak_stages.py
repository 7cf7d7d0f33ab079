"""What the fault soak's stages share: their commands, a killable start, the phase a kill met,
and the comparisons of a rerun's outputs with the reference's (`bench.soak`,
`bench.soak_faults`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pandas as pd
import pyarrow as pa

from features.schema import candidate_store
from specrank.store.trace_schema import trace_store

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["debug=default"]
PROMPTS = ["data.sources.0.limit=3", "data.sources.1.limit=3"]  # the stages that decode
TRACE_KEYS = ["prompt_id", "temperature", "rule", "budget", "round_index"]
CAND_KEYS = [*TRACE_KEYS, "cand_index"]


def stage_commands(root: Path, out: str, attempt: int = 0, inputs: str = "ref",
                   tracking: str | None = None) -> dict[str, list[str]]:  # fmt: skip
    """The four stages' command lines writing under `root/out` (run folders per `attempt`);
    extraction and training read the traces and features under `root/inputs`."""
    o, i = root / out, root / inputs
    uri = tracking or f"sqlite:///{o / 'mlflow.db'}"
    py = [sys.executable, "-m"]
    return {
        "record": [*py, "decode.record", "-m", *SUITE, *PROMPTS, f"paths.traces={o / 'traces'}",
                   f"hydra.sweep.dir={o / f'h_record_{attempt}'}"],
        "extract": [*py, "features.extract", *SUITE, f"traces={i / 'traces'}",
                    f"out={o / 'features'}", f"hydra.run.dir={o / f'h_extract_{attempt}'}"],
        "train": [*py, "rerank.train", *SUITE, f"paths.traces={i / 'traces'}",
                  f"paths.features={i / 'features'}", f"mlflow.tracking_uri={uri}",
                  "rerank.booster.n_threads=1", f"hydra.run.dir={o / f'h_train_{attempt}'}"],
        "online": [*py, "decode.run", *SUITE, *PROMPTS, "run.score=record", "run.record_traces=true",
                   f"run.traces_out={o / 'online'}", "select.budget=8", f"mlflow.tracking_uri={uri}",
                   f"hydra.run.dir={o / f'h_online_{attempt}'}"],
    }  # fmt: skip


def run(
    cmd: list[str], env: dict | None = None, timeout: float = 1800
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start(cmd: list[str], phase_file: Path, faults: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "SPECRANK_PHASE_FILE": str(phase_file)}
    if faults:
        env["SPECRANK_FAULTS"] = faults
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def read_phase(path: Path) -> str:
    try:
        return path.read_text().strip() or "starting"
    except FileNotFoundError:
        return "starting (imports, config, model load)"


# -- comparisons ---------------------------------------------------------------------------------


def _frame(table: pa.Table, keys: list[str]) -> pd.DataFrame:
    cols = [c for c in table.column_names if not c.startswith("time_")]
    frame = table.select(cols).to_pandas()
    if frame.duplicated(keys).any():
        raise AssertionError(f"duplicate rows under {keys}: {int(frame.duplicated(keys).sum())}")
    return frame.sort_values(keys).reset_index(drop=True)


def same_store(got: Path, want: Path, kind: str) -> None:
    """Every non-timing column equal, no duplicates, no leftover temp or claim files."""
    store, keys = (trace_store, TRACE_KEYS) if kind == "trace" else (candidate_store, CAND_KEYS)
    a, b = _frame(store(got).read(), keys), _frame(store(want).read(), keys)
    pd.testing.assert_frame_equal(a, b, check_exact=True)
    left = [p.name for p in got.iterdir() if ".tmp" in p.name or ".claim" in p.name]
    if left:
        raise AssertionError(f"{got}: leftover files {left}")


def same_run_folder(got: Path, want: Path) -> None:
    """Result tables equal (timing columns aside); LightGBM models byte for byte."""
    for path in sorted(want.glob("*.csv")) + sorted(want.glob("*.parquet")):
        read = pd.read_csv if path.suffix == ".csv" else pd.read_parquet
        a, b = read(got / path.name), read(path)
        drop = [c for c in b.columns if "seconds" in c or c.endswith("_s") or c == "time"]
        pd.testing.assert_frame_equal(a.drop(columns=drop), b.drop(columns=drop), check_exact=True)
    if (got / "results.txt").read_text() != (want / "results.txt").read_text():
        raise AssertionError(f"{got}/results.txt differs from the reference")
    for model in sorted(want.glob("rerankers/*/model.txt")):
        mine = got / model.relative_to(want)
        if mine.read_bytes() != model.read_bytes():
            raise AssertionError(f"{mine} differs from the reference byte for byte")
    if not (got / "mlflow_logged.json").exists():
        raise AssertionError(f"{got}: not logged to MLflow")


def mlflow_statuses(uri: str) -> Counter:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    return Counter(r.info.status for r in client.search_runs(exps)) if exps else Counter()


def while_writing(phase: str) -> bool:
    """A kill while a shard, its marker or a results table was being written."""
    return phase.startswith(("writing", "killed at shard", "killed at table"))


# -- the soak ------------------------------------------------------------------------------------
