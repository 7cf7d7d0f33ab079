"""Figures of a run (issue 18): rendered on a debug-size job, checked for invariants, not pixels."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import matplotlib.colors as mcolors
import mlflow
import numpy as np
import pandas as pd
import pytest

from features.extract import extract
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.report.plot_style import COLORS, MARKERS, family_of, group_rules, styles
from rerank.report.plots_gain import comparison_forest, gain_figure
from rerank.report.plots_reliability import EDGES, reliability_figure
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from tree.config import PoolConfig, SelectConfig

BUDGETS = [2, 8, 16]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str, str]:
    """The main job on small synthetic traces: (run folder, tracking URI, run id)."""
    root = tmp_path_factory.mktemp("plots")
    job = SynthJobConfig(toy_prompts=12, rounds_per_prompt=10, prompts_per_shard=6)
    pool, select = PoolConfig(top_k=6, expand_steps=3, expand=6), SelectConfig("draft", 8, 20)
    write_synthetic_traces(root / "traces", job, pool, select, SynthConfig(), seed=0)
    extract(root / "traces", root / "features", log=lambda _: None)
    cfg = RerankConfig(
        traces=str(root / "traces"),
        features=str(root / "features"),
        booster=BoosterConfig(kind="lgbm", n_threads=1),
        budgets=BUDGETS,
        n_resamples=200,
        calibration_edges=20_000,
        chunk_rounds=256,
        reports=False,
    )
    uri = f"sqlite:///{root / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    try:
        result = train_and_evaluate(
            cfg, MlflowConfig(tracking_uri=uri, experiment="plots"), {"rerank": asdict(cfg)}, 0,
            root / "out",
        )  # fmt: skip
    finally:
        mlflow.set_tracking_uri(previous)  # train_and_evaluate sets it process-wide
    return root / "out", uri, result.run_id


def _legend_styles(ax) -> list[tuple[str, str, str]]:
    """(label, colour, marker) of every labelled line of a panel."""
    return [
        (line.get_label(), mcolors.to_hex(line.get_color()), str(line.get_marker()))
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    ]


def test_every_figure_is_written_beside_the_tables_and_logged(run):
    out, uri, run_id = run
    expected = {"comparisons.png"} | {
        f"{kind}_{law}.png" for kind in ("gain_vs_budget", "reliability")
        for law in ("greedy", "sampling")
    }  # fmt: skip
    assert (out / "summary.csv").is_file() and (out / "reliability.csv").is_file()
    assert expected <= {p.name for p in out.glob("*.png")}
    logged = {Path(f.path).name for f in mlflow.MlflowClient(uri).list_artifacts(run_id, "plots")}
    assert logged == {p.name for p in out.glob("*.png")}
    tables = {Path(f.path).name for f in mlflow.MlflowClient(uri).list_artifacts(run_id, "tables")}
    assert {"summary.csv", "comparisons.csv", "reliability.csv"} <= tables


def test_gain_panels_tell_every_rule_apart_at_the_evaluated_budgets(run):
    out, _, _ = run
    summary = pd.read_csv(out / "summary.csv")
    for law in ("greedy", "sampling"):
        fig = gain_figure(summary, law)
        panels = [ax for ax in fig.axes if ax.get_visible()]
        drawn = []
        part = summary[(summary["law"] == law) & (summary["weighting"] == "round")]
        for ax in panels:
            seen = _legend_styles(ax)
            pairs = [(c, m) for _, c, m in seen]
            assert len(set(pairs)) == len(pairs), f"{law}/{ax.get_title()}: {seen}"
            assert [int(t) for t in ax.get_xticks()] == BUDGETS
            assert [t.get_text() for t in ax.get_xticklabels()] == [str(b) for b in BUDGETS]
            rules = [label for label, _, _ in seen]
            drawn += rules
            # the panel's y range holds its own rules' intervals and zero, and no more than
            # a margin beyond them (not the range of another family)
            r = part[part["rule"].isin(rules)]
            low = min(0.0, 100 * r[["gain", "gain_lo"]].min().min())
            high = max(0.0, 100 * r[["gain", "gain_hi"]].max().max())
            y0, y1 = ax.get_ylim()
            assert y0 <= low and y1 >= high
            assert (y1 - y0) <= 1.2 * (high - low) + 1e-9
            zero = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [0, 0]]
            assert zero, "draft selection (0) is marked"
            assert ax.collections, "intervals are drawn as bands"
        # every rule but the baseline is drawn exactly once, none dropped
        assert sorted(drawn) == sorted(set(part["rule"]) - {"draft"})


def test_forest_has_every_comparison_at_every_budget_and_zero(run):
    out, _, _ = run
    comparisons = pd.read_csv(out / "comparisons.csv")
    fig = comparison_forest(comparisons)
    sub = comparisons[comparisons["weighting"] == "round"]
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == list(dict.fromkeys(sub["law"]))
    for ax, law in zip(axes, dict.fromkeys(sub["law"]), strict=True):
        points = sorted(
            round(float(x), 9)
            for c in ax.containers  # one errorbar container per (pair, budget)
            for x in c.lines[0].get_xdata()
        )
        assert points == sorted(round(100 * g, 9) for g in sub[sub["law"] == law]["gain"])
        assert any(list(ln.get_xdata()) == [0, 0] for ln in ax.get_lines()), "zero marked"
        headers = {t.get_text() for t in ax.texts}
        assert headers == {f"{a} vs {b}" for a, b in zip(sub["a"], sub["b"], strict=True)}


def test_reliability_counts_cover_every_candidate(run):
    out, _, _ = run
    table = pd.read_csv(out / "reliability.csv")
    oof = pd.read_parquet(out / "oof_predictions.parquet")
    for law, temperature in (("greedy", 0.0), ("sampling", 1.0)):
        part = table[table["law"] == law]
        n = int((oof["temperature"] == temperature).sum())
        counts = part.groupby("predictor")["count"].sum()
        assert (counts == n).all(), counts  # every candidate in exactly one bin
        assert set(counts.index) >= {"draft_prob", "base_lgbm", "rows_lgbm"}
        assert len(part) == len(counts) * (len(EDGES) - 1)
        fig = reliability_figure(table, law)
        curve, strip = fig.axes
        seen = _legend_styles(curve)
        assert len({(c, m) for _, c, m in seen}) == len(seen)
        assert len(strip.patches) == len(counts), "one count strip per predictor"


def test_families_by_prefix_and_unknown_rules_kept():
    expect = {
        "root": "exact", "root_softmax": "exact", "depth_two": "exact", "oracle": "exact",
        "root_if_covered": "exact", "base_hgb": "learned", "rows_lgbm": "learned",
        "rows_lgbm_es": "learned", "rank_control": "learned", "rows": "learned",
        "iso_q1": "calibrators", "per_depth": "calibrators", "sub_cache": "substitutions",
        "mix_prev": "mixtures", "root_draw": "draw", "root_draw_v2": "draw", "pearl": "draw",
        "pearl_matched": "draw", "rowsy": "other", "something_new": "other",
    }  # fmt: skip
    assert {r: family_of(r).key for r in expect} == expect
    groups = group_rules(["draft", *expect])
    assert sorted(r for _, rules in groups for r in rules) == sorted(expect)  # draft is the zero
    assert groups[-1][0].key == "other"


def test_styles_never_repeat_colour_and_marker():
    many = styles([f"r{i}" for i in range(len(COLORS) * len(MARKERS))])
    assert len({(s.color, s.marker) for s in many.values()}) == len(many)
    assert np.gcd(len(COLORS), len(MARKERS)) == 1
