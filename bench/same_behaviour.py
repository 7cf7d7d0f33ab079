"""Behaviour fingerprint of the pipeline on a fixed store, through the command lines only.

    python -m bench.same_behaviour --store DIR --out before.json   # builds DIR once
    python -m bench.same_behaviour --store DIR --out after.json --compare before.json

The store (pocket traces of the debug suite, both laws, recorded once into DIR, and a
synthetic store) is read by every later run, so two code trees are compared on the same
input. Fingerprinted, every timing column aside:
- the candidate table `features.extract` writes from those traces (sha256 per column);
- every rule value `rerank.train` gives per round and budget (per_round_values.parquet,
  keyed by rule and budget whatever the column names), and its summary and comparisons;
- online decodes of `decode.run` at T=0 and at T=1 (seeded) for every online rule, the
  reranker included (the saved model of the training run): each round's accepted length,
  tree size and passes, and with run.score=record the full trace rows.
`--compare` exits 1 naming every entry that differs. Only the `python -m` lines are used,
so the same script checks a tree whose modules moved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SUITE = ["debug=default", "data.sources.0.limit=3", "data.sources.1.limit=3"]
ONLINE_RULES = ["draft", "root", "root_draw", "pearl", "covering", "reranker"]
VALUE = re.compile(r"^(?P<rule>.+)@B(?P<budget>\d+)$")


def _run(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"python -m {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def _digest(frame: pd.DataFrame, keys: list[str]) -> dict[str, str]:
    """sha256 of each non-timing column, rows sorted by `keys`."""
    frame = frame.sort_values(keys).reset_index(drop=True)
    out = {}
    for c in sorted(frame.columns):
        if c.startswith(("time_", "ms_")) or c in ("ms", "prefill_ms", "seconds"):
            continue
        data = pd.util.hash_pandas_object(frame[c].astype("string"), index=False).to_numpy()
        out[c] = hashlib.sha256(data.tobytes()).hexdigest()[:16]
    return out


def _parquet_folder(folder: Path) -> pd.DataFrame:
    return pq.read_table(sorted(str(p) for p in folder.glob("shard-*.parquet"))).to_pandas()


def build_store(store: Path) -> None:
    if (store / "traces" / "manifest.json").exists():
        return
    _run(["decode.record", "-m", *SUITE, f"paths.traces={store / 'traces'}",
          f"hydra.sweep.dir={store / 'h'}"])  # fmt: skip
    _run(["decode.synth_traces", "debug=default", f"paths.synthetic={store / 'synth'}",
          f"hydra.run.dir={store / 'h_synth'}"])  # fmt: skip


def fingerprint(store: Path, work: Path) -> dict:
    out: dict = {}
    trace_keys = ["prompt_id", "temperature", "rule", "budget", "round_index"]
    for name in ("traces", "synth"):
        feats = work / f"features_{name}"
        _run(["features.extract", "debug=default", f"traces={store / name}", f"out={feats}",
              f"hydra.run.dir={work / f'h_extract_{name}'}"])  # fmt: skip
        out[f"candidates/{name}"] = _digest(_parquet_folder(feats), [*trace_keys, "cand_index"])
    run = work / "train"
    _run(["rerank.train", "debug=default", f"paths.traces={store / 'traces'}",
          f"paths.features={work / 'features_traces'}", "rerank.booster.n_threads=1",
          f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", f"hydra.run.dir={run}"])  # fmt: skip
    wide = pd.read_parquet(run / "per_round_values.parquet")
    keys = [c for c in ("prompt_id", "temperature", "rule", "budget", "round_index") if c in wide]
    values = {}
    for c in wide.columns:
        m = VALUE.match(c)
        if m and not c.startswith("size/"):
            col = wide[[*keys, c]].sort_values(keys)[c].to_numpy()
            values[f"{m['rule']}|B{m['budget']}"] = hashlib.sha256(col.tobytes()).hexdigest()[:16]
    out["rule_values"] = values
    for table in ("summary", "comparisons"):
        frame = pd.read_csv(run / f"{table}.csv")
        kcols = [c for c in ("law", "budget", "weighting", "rule", "a", "b") if c in frame]
        out[table] = _digest(frame, kcols)
    reranker = {0.0: sorted((run / "rerankers").glob("rows_lgbm_T0_fold0"))[0],
                1.0: sorted((run / "rerankers").glob("rows_lgbm_T1_fold0"))[0]}  # fmt: skip
    for temperature in (0.0, 1.0):
        for rule in ONLINE_RULES:
            for score in ("tree", "record") if rule != "covering" else ("tree",):
                # `_pool`: run.score=record was called pool when the baseline was taken
                tag = f"{rule}_T{temperature:g}_{'pool' if score == 'record' else score}"
                args = ["decode.run", *SUITE, f"run.rule={rule}", f"decode.temperature={temperature}",
                        "select.budget=8", f"run.score={score}", f"hydra.run.dir={work / tag}",
                        f"mlflow.tracking_uri=sqlite:///{work / 'mlflow.db'}", "run.baseline=false"]  # fmt: skip
                if rule == "reranker":
                    args += [f"run.reranker={reranker[temperature]}", "run.seen_prompts=allow"]
                if score == "record":
                    args += ["run.record_traces=true", f"run.traces_out={work / ('t_' + tag)}"]
                _run(args)
                rounds = pd.read_parquet(work / tag / "online_rounds.parquet")
                out[f"online/{tag}"] = _digest(rounds, ["prompt_id", "round_index", "budget"])
                if score == "record":
                    out[f"online_traces/{tag}"] = _digest(
                        _parquet_folder(work / ("t_" + tag)), trace_keys
                    )
    return out


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    diff = []
    for k in sorted(set(a) | set(b)):
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            diff += _differences(a[k], b[k], f"{prefix}{k}/")
        elif a.get(k) != b.get(k):
            diff.append(f"{prefix}{k}: {a.get(k)} != {b.get(k)}")
    return diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, required=True, help="the fixed store (built once)")
    ap.add_argument("--out", type=Path, required=True, help="the fingerprint (JSON)")
    ap.add_argument("--work", type=Path, default=None, help="default: <out>.work")
    ap.add_argument("--compare", type=Path, default=None, help="a fingerprint to compare with")
    args = ap.parse_args()
    build_store(args.store)
    work = args.work or args.out.with_suffix(".work")
    work.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(args.store, work)
    args.out.write_text(json.dumps(fp, indent=1, sort_keys=True))
    n = sum(len(v) if isinstance(v, dict) else 1 for v in fp.values())
    print(f"{n} fingerprints in {args.out}")
    if args.compare:
        diff = _differences(json.loads(args.compare.read_text()), fp)
        print("identical" if not diff else "DIFFERENT:\n" + "\n".join(diff))
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
