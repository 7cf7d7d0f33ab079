"""notebooks/compare_runs.ipynb and its reading helpers (`rerank.report.runs`), on runs at debug size.

The notebook is stored without outputs; here it is executed with nbclient on
two runs that `rerank.train` logged to a temporary SQLite store, parameterised
through `SPECRANK_*` environment variables.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, replace
from pathlib import Path

import mlflow
import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient
from traitlets.config import Config

from features.extract import extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.report import run_tables as T
from rerank.report import runs as R
from rerank.report.acceptance import acceptance_cell
from rerank.train import TrainResult, train_and_evaluate
from specrank.settings.config import MlflowConfig
from tree.config import PoolConfig, SelectConfig

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "compare_runs.ipynb"
EXPERIMENT = "nb"


def _dirty_cells(raw: dict) -> list[int]:
    """Code cells holding outputs, an execution count or run timings."""
    return [
        i
        for i, cell in enumerate(raw["cells"])
        if cell["cell_type"] == "code"
        and (
            cell.get("outputs")
            or cell.get("execution_count") is not None
            or "execution" in cell.get("metadata", {})
        )
    ]


def test_notebook_is_stored_without_outputs():
    """Outputs and execution counts never enter git (strip them before committing)."""
    raw = json.loads(NOTEBOOK.read_text())
    nbformat.validate(nbformat.reads(NOTEBOOK.read_text(), as_version=4))
    dirty = _dirty_cells(raw)
    assert dirty == [], (
        f"cells {dirty} of {NOTEBOOK.name} hold outputs or execution counts: clear them "
        "before committing (notebooks/DASHBOARD.md has a one-line command)"
    )
    assert "widgets" not in raw["metadata"], "widget state is output too"
    assert raw["metadata"]["kernelspec"]["name"] == "python3"
    # the check itself sees each kind of leftover
    code = next(i for i, c in enumerate(raw["cells"]) if c["cell_type"] == "code")
    for key, value in [
        ("outputs", [{"output_type": "stream", "name": "stdout", "text": "x"}]),
        ("execution_count", 1),
        ("metadata", {"execution": {"iopub.status.idle": "2026-01-01T00:00:00Z"}}),
    ]:
        copy = json.loads(json.dumps(raw))
        copy["cells"][code][key] = value
        assert _dirty_cells(copy) == [code], key


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> tuple[str, list[TrainResult]]:
    """Two runs of the main job in one experiment, with different settings."""
    root = tmp_path_factory.mktemp("nb")
    job = SynthJobConfig(toy_prompts=8, rounds_per_prompt=8, prompts_per_shard=4)
    pool, select = PoolConfig(top_k=6, expand_steps=3, expand=6), SelectConfig("draft", 8, 20)
    write_synthetic_traces(root / "traces", job, pool, select, SynthConfig(), seed=0)
    extract(root / "traces", root / "features", log=lambda _: None)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    first = RerankConfig(
        traces=str(root / "traces"),
        features=str(root / "features"),
        booster=BoosterConfig(kind="lgbm", n_threads=1),
        n_resamples=200,
        calibration_edges=20_000,
        chunk_rounds=256,
    )
    # the second run logs fewer rules and other halves: the notebook must line them up
    second = replace(first, halves="even_odd", calibrators=[], substitutions=["cache"])
    previous_uri = mlflow.get_tracking_uri()
    results = []
    try:
        for i, cfg in enumerate([first, second]):
            results.append(
                train_and_evaluate(
                    cfg,
                    MlflowConfig(tracking_uri=uri, experiment=EXPERIMENT, run_name=f"run{i}"),
                    {"rerank": asdict(cfg), "seed": i},
                    i,
                    root / f"out{i}",
                )
            )
        # a later run that `rerank.train` did not log: never picked as a run to compare
        client = mlflow.MlflowClient(uri)
        exp = client.get_experiment_by_name(EXPERIMENT)
        other = client.create_run(exp.experiment_id, run_name="not-a-train-run")
        client.set_terminated(other.info.run_id)
    finally:
        mlflow.set_tracking_uri(previous_uri)  # train_and_evaluate sets it process-wide
    return uri, results


def _row(summary: pd.DataFrame, rule: str, law: str, budget: int) -> pd.Series:
    s = summary
    return s[(s["rule"] == rule) & (s["law"] == law) & (s["budget"] == budget)
             & (s["weighting"] == "round")].iloc[0]  # fmt: skip


def test_runs_are_found_and_their_tables_read_back(logged, tmp_path):
    uri, results = logged
    runs = R.find_runs(uri, EXPERIMENT, last=2)
    assert list(runs["run_id"]) == [r.run_id for r in results]  # oldest first
    assert list(runs["run"]) == ["run0 (lgbm)", "run1 (lgbm)"]
    picked = R.find_runs(uri, run_ids=[results[1].run_id, results[0].run_id])
    assert list(picked["run_id"]) == [results[1].run_id, results[0].run_id]

    tables = R.load_run_tables(results[0].run_id, uri, dst=tmp_path / "t")
    pd.testing.assert_frame_equal(
        tables["summary"], results[0].summary.reset_index(drop=True), check_dtype=False
    )
    both = R.load_runs(runs, uri, dst=tmp_path / "both")
    assert list(both["summary"]["run"].cat.categories) == list(runs["run"])
    # every fitted feature set lines up across model kinds: `rows_lgbm` is shown as `rows`
    fitted = RerankConfig().feature_sets
    assert fitted == ["base", "rows", "rows_extra"]  # the run fitted all three
    kinded = {f"{s}_lgbm" for s in fitted}
    assert kinded <= set(results[0].summary["rule"])
    renamed = set(results[0].summary["rule"]) - kinded | set(fitted)
    assert set(both["summary"]["rule"]) == renamed
    assert "rows" in set(both["prediction_quality"]["predictor"])

    differ = R.differing_params(runs, uri)
    assert {"rerank.halves", "rerank.calibrators", "seed"} <= set(differ.index)
    assert "rerank.n_resamples" not in differ.index

    table = T.side_by_side(both["summary"], "gain")
    r = _row(results[1].summary, "rows_lgbm", "sampling", 8)
    cell = table.loc[("sampling", "rows"), (8, "run1 (lgbm)")]
    assert cell == T.format_interval(r["gain"], r["gain_lo"], r["gain_hi"])
    assert table.loc[("greedy", "iso_q1"), (8, "run1 (lgbm)")] == ""  # not logged by run 1

    gains = T.group_gains(both["breakdowns"])
    assert (gains.loc[gains["rule"] == "draft", "gain"] == 0).all()
    bd = results[0].breakdowns  # long: one row per law, grouping, group, rule and budget
    in_task = bd[(bd["law"] == "sampling") & (bd["by"] == "task") & (bd["budget"] == 59)]
    group = in_task["group"].iloc[0]
    mean = in_task[in_task["group"] == group].set_index("rule")["accepted"]
    g = gains[(gains["run"] == "run0 (lgbm)") & (gains["law"] == "sampling") & (gains["by"] == "task")
              & (gains["group"] == group) & (gains["rule"] == "rows")
              & (gains["budget"] == 59)]  # fmt: skip
    assert g["gain"].item() == pytest.approx(mean["rows_lgbm"] / mean["draft"] - 1)
    # a run logged before the breakdowns were long wrote a wide row per group
    wide = bd.assign(column=[f"{r}@B{b}" for r, b in zip(bd["rule"], bd["budget"], strict=True)])
    wide = wide.pivot_table(index=["law", "by", "group", "rounds"], columns="column",
                            values="accepted").reset_index()  # fmt: skip
    keys = ["law", "by", "group", "rule", "budget"]
    pd.testing.assert_frame_equal(
        T.group_gains(wide).sort_values(keys).reset_index(drop=True),
        T.group_gains(bd.drop(columns="target_temperature"))[[*wide.columns[:4], "rule",
            "budget", "accepted", "gain"]].sort_values(keys).reset_index(drop=True),
        check_dtype=False,
    )  # fmt: skip
    # a run logged before the law's temperature was a column reads the same, beside new ones
    old = both["breakdowns"].assign(
        target_temperature=lambda f: f["target_temperature"].where(f["run"] != "run0 (lgbm)")
    )
    assert "target_temperature" in both["summary"] and "target_temperature" in gains
    before = T.group_gains(both["breakdowns"].drop(columns="target_temperature"))
    pd.testing.assert_frame_equal(before, gains.drop(columns="target_temperature"))
    mixed = T.group_gains(old)  # old run0 (no temperature) beside a new run1
    assert len(mixed) == len(gains) and (mixed.loc[mixed["rule"] == "draft", "gain"] == 0).all()
    assert set(R.download_plots(results[0].run_id, uri, tmp_path / "p")) >= {
        "gain_vs_budget_sampling",
        "reliability_sampling",
    }


def test_learned_rules_of_any_model_kind_line_up():
    summary = pd.DataFrame({"rule": ["draft", "base_hgb", "rows_hgb", "rows_lgbm"]})
    out = R.unify_model_rules("summary", summary, "hgb")
    assert list(out["rule"]) == ["draft", "base", "rows", "rows_lgbm"]  # only the run's own kind
    quality = pd.DataFrame({"predictor": ["draft_prob", "rows_hgb", "iso_q1"]})
    out = R.unify_model_rules("prediction_quality", quality, "hgb")
    assert list(out["predictor"]) == ["draft_prob", "rows", "iso_q1"]
    bd = pd.DataFrame(columns=["law", "group", "draft@B8", "rows_hgb@B8", "base_hgb@B59"])
    out = R.unify_model_rules("breakdowns", bd, "hgb")
    assert list(out.columns) == ["law", "group", "draft@B8", "rows@B8", "base@B59"]


def test_bad_selections_name_the_setting(logged, tmp_path):
    uri, results = logged
    with pytest.raises(LookupError, match="SPECRANK_RUN_IDS: run 'nope' not found"):
        R.find_runs(uri, run_ids=["nope"])
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    child = client.search_runs(
        [exp.experiment_id], f"tags.mlflow.parentRunId = '{results[0].run_id}'"
    )[0]
    with pytest.raises(ValueError, match=r"not a `rerank\.train` parent run"):
        R.find_runs(uri, run_ids=[child.info.run_id])
    with pytest.raises(LookupError, match=r"SPECRANK_EXPERIMENT: experiment 'x' not found.*'nb'"):
        R.find_runs(uri, "x")
    missing = tmp_path / "absent.db"
    with pytest.raises(FileNotFoundError, match="no such SQLite store"):
        R.find_runs(f"sqlite:///{missing}", EXPERIMENT)
    assert not missing.exists()  # reading never creates a store
    with pytest.raises(ValueError, match="SPECRANK_LAST: expected a positive integer, found 0"):
        R.selection_from_env({"SPECRANK_LAST": "0"})
    with pytest.raises(ValueError, match="SPECRANK_WEIGHTING: expected one of"):
        R.selection_from_env({"SPECRANK_WEIGHTING": "rounds"})
    with pytest.raises(ValueError, match=r"SPECRANK_RULES: rules \['rows_hgb'\] were not logged"):
        T.select_rules(results[0].summary, ["rows_lgbm", "rows_hgb"])
    assert T.headline_budgets(results[0].summary) == [8, 59]
    assert T.headline_budgets(results[0].summary, [59]) == [59]
    with pytest.raises(ValueError, match=r"SPECRANK_BUDGETS: budgets \[7\] were not logged"):
        T.headline_budgets(results[0].summary, [7])
    with pytest.raises(ValueError, match="SPECRANK_BUDGETS: expected comma-separated integers"):
        R.selection_from_env({"SPECRANK_BUDGETS": "8,B59"})
    sel = R.selection_from_env({"SPECRANK_RUN_IDS": " a, b ,", "SPECRANK_RULES": "root"})
    assert sel.run_ids == ("a", "b") and sel.rules == ("root",) and sel.last == 2


def _texts(nb) -> tuple[str, list[str], int]:
    """All text/HTML outputs joined, stderr stream texts, and the number of PNG outputs."""
    texts, stderr, images = [], [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                (stderr if out["name"] == "stderr" else texts).append(out["text"])
            elif out["output_type"] == "error":
                texts.append("\n".join(out["traceback"]))
            else:
                data = out.get("data", {})
                images += "image/png" in data
                texts += [data.get("text/html", ""), data.get("text/plain", "")]
    return "\n".join(texts), stderr, images


def test_notebook_executes_on_logged_runs(logged, tmp_path, monkeypatch):
    uri, results = logged
    ids = [r.run_id for r in results]
    for key in list(os.environ):
        if key.startswith("SPECRANK_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv(R.ENV_TRACKING_URI, uri)
    monkeypatch.setenv(R.ENV_RUN_IDS, ",".join(ids))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # IPC sockets in tmp: no kernel on a TCP port, and nothing written beside the notebook
    config = Config({"KernelManager": {"transport": "ipc", "ip": str(tmp_path / "kernel")}})
    NotebookClient(
        nb,
        config=config,
        kernel_name="python3",
        timeout=240,
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    text, stderr, images = _texts(nb)
    assert stderr == [], f"the notebook wrote to stderr (warnings?):\n{''.join(stderr)}"
    # forest plots of gain, share of root and of oracle; gain vs budget; reliability; entropy
    assert images >= 6, f"expected at least 6 figures, found {images}"
    for r, label in zip(results, ["run0 (lgbm)", "run1 (lgbm)"], strict=True):
        assert label in text
        assert r.run_id in text
        row = _row(r.summary, "rows_lgbm", "greedy", 8)
        # the headline table shows exactly the logged gain and interval of every run
        assert T.format_interval(row["gain"], row["gain_lo"], row["gain_hi"]) in text
        assert r.table.strip().splitlines()[-1].strip() in text  # the printed results table
        # the acceptance report side by side: every run's figure, as it printed it
        acc = r.acceptance.table
        cell = acc[(acc["estimator"] == "vllm_logit_q") & (acc["metric"] == "auroc")
                   & (acc["candidates"] == "top") & (acc["law"] == "greedy")].iloc[0]  # fmt: skip
        assert acceptance_cell(cell) in text
    assert re.search(r"rerank\.halves", text), "the differing settings are listed"
