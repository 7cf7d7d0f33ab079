"""Seed 003's protocol in decode.run: budget elasticity, per-stage medians, one entropy split per run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from decode.baseline import row_entropies
from decode.config import RunConfig
from decode.elasticity import budget_elasticity
from decode.metrics import entropy_halves, group_metrics, task_entropy
from decode.round import STAGES
from decode.run import run_online
from decode.settings import OnlineSettings
from pairs.config import DataConfig, PromptSource
from tests.online_fixtures import PROMPTS, settings
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair


def _prompts(tokens, ms, emitted, rounds) -> pd.DataFrame:
    return pd.DataFrame(
        {"prompt_id": ["a", "b"], "tokens": tokens, "ms": ms, "emitted": emitted, "rounds": rounds}
    )


def test_elasticity_hand_computed():
    # B=2: TPS = 1000 * 30 / 200 = 150, tau = 30 / 15 = 2; B=4: TPS = 150, tau = 30 / 10 = 3
    table = {
        2: _prompts([10, 20], [100.0, 100.0], [10, 20], [5, 10]),
        4: _prompts([10, 20], [50.0, 150.0], [10, 20], [4, 6]),
    }
    e = budget_elasticity(table, n_resamples=200, seed=0).iloc[0]
    assert (e["from_budget"], e["to_budget"]) == (2, 4)
    assert e["d_ln_tps"] == pytest.approx(0.0, abs=1e-12)
    assert e["d_ln_tau"] == pytest.approx(math.log(1.5))
    assert e["d_ln_eta"] == pytest.approx(-math.log(1.5))
    assert e["ln_eta_from"] == pytest.approx(math.log(75.0))  # eta = TPS / tau
    for q in ("tps", "tau", "eta"):
        assert e[f"d_ln_{q}_lo"] <= e[f"d_ln_{q}"] + 1e-12 <= e[f"d_ln_{q}_hi"] + 2e-12
    with pytest.raises(ValueError, match="same prompts"):
        budget_elasticity({2: table[2], 4: table[4].assign(prompt_id=["a", "c"])}, 10, 0)
    assert budget_elasticity({2: table[2]}, 10, 0).empty


def test_stage_medians_are_numpy_medians():
    rng = np.random.default_rng(0)
    n = 7
    rounds = pd.DataFrame({"prompt_id": ["a"] * n, "task": "t", "tau": rng.integers(1, 4, n),
                           "accepted": 0, "tree_size": 1, "scored": 1, "root_entropy": 1.0,
                           **{f"ms_{s}": rng.exponential(size=n) for s in STAGES}})  # fmt: skip
    prompts = pd.DataFrame({"prompt_id": ["a"], "task": ["t"], "tokens": [9], "ms": [5.0],
                            "passes": [n], "baseline_ms": [0.0], "baseline_tokens": [0]})  # fmt: skip
    m = group_metrics(rounds, prompts, 10, 0)
    for s in STAGES:
        assert m[f"ms_per_round_median/{s}"] == np.median(rounds[f"ms_{s}"].to_numpy())
        assert m[f"ms_per_round/{s}"] == pytest.approx(rounds[f"ms_{s}"].mean())
    total = rounds[[f"ms_{s}" for s in STAGES]].to_numpy().sum(1)
    assert m["ms_per_round_median/total"] == pytest.approx(np.median(total))


def test_task_entropy_prefers_the_baseline():
    rounds = pd.DataFrame({"task": ["x", "y"], "root_entropy": [5.0, 0.1]})
    prompts = pd.DataFrame({"task": ["x", "x", "y"], "baseline_entropy_sum": [1.0, 2.0, 10.0],
                            "baseline_entropy_tokens": [2, 4, 5]})  # fmt: skip
    means, source = task_entropy(rounds, prompts)
    assert source == "baseline" and means.to_dict() == {"x": 0.5, "y": 2.0}
    assert entropy_halves(means) == {"x": "low", "y": "high"}  # the rounds would say the reverse
    fallback, source = task_entropy(rounds, prompts.assign(baseline_entropy_tokens=0))
    assert source == "rounds" and entropy_halves(fallback) == {"y": "low", "x": "high"}


def test_row_entropies_match_a_full_forward(tmp_path):
    pair = tiny_pair(tmp_path / "m", "llama")
    prompt, output = [5, 9, 13, 7], [11, 3, 42, 8, 8]
    with one_thread(), torch.inference_mode():
        got = row_entropies(pair.target, prompt, output, 0.7, chunk=2)
        logits = pair.target(input_ids=torch.tensor([[*prompt, *output]])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1].double() / 0.7, -1)
    np.testing.assert_allclose(got, -(logp.exp() * logp).sum(-1).numpy(), rtol=1e-4)


def _data(tmp_path: Path) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n" for p in PROMPTS[:4]
        )
    )
    return DataConfig(name="tiny", sources=[PromptSource(kind="jsonl", path=str(path))])


def test_run_reports_elasticity_medians_and_one_entropy_split(tmp_path):
    model_cfg = tiny_model_config(tmp_path / "models", "llama")
    reports = {}
    for rule in ("draft", "root_draw"):
        run = RunConfig(rule=rule, budgets=[4, 2], warmup_prompts=0, bootstrap_resamples=100,
                        progress=False)  # fmt: skip
        s = OnlineSettings(settings(rule, 1.0, budget=2, max_new_tokens=10).base, rule)
        with one_thread():
            reports[rule] = run_online(
                model_cfg, _data(tmp_path), s, run, None, {}, tmp_path / rule
            )
    for rep in reports.values():
        m = rep.metrics
        assert sorted(rep.rounds["budget"].unique()) == [2, 4]
        e = rep.elasticity.iloc[0]
        assert (e["from_budget"], e["to_budget"]) == (2, 4)  # select.budget=2 first, then 4
        key = "online/elasticity/B2_B4"
        assert m[f"{key}/d_ln_tps"] == pytest.approx(
            m[f"{key}/d_ln_tau"] + m[f"{key}/d_ln_eta"], abs=1e-12
        )
        # ... on the numbers the groups report: TPS and tau of each budget
        tps = {b: m[f"online/B{b}/tokens_per_s"] for b in (2, 4)}
        tau = {b: m[f"online/B{b}/tau"] for b in (2, 4)}
        assert m[f"{key}/d_ln_tps"] == pytest.approx(math.log(tps[4] / tps[2]), rel=1e-9)
        assert m[f"{key}/d_ln_tau"] == pytest.approx(math.log(tau[4] / tau[2]), rel=1e-9)
        assert m["online/tau"] == m["online/B2/tau"]  # the plain keys are select.budget's
        primary = rep.rounds[rep.rounds["budget"] == 2]
        for st in STAGES:
            assert m[f"online/ms_per_round_median/{st}"] == pytest.approx(
                np.median(primary[f"ms_{st}"])
            )
        assert m["online/entropy_split_from_baseline"] == 1.0
        assert {"online/entropy/low/tau", "online/entropy/high/tau"} <= set(m)
    a, b = (reports[r].entropy.set_index("task") for r in ("draft", "root_draw"))
    assert (a["source"] == "baseline").all()
    pd.testing.assert_frame_equal(a, b)  # one split per target, from the shared baseline
    assert set(a.loc[a["half"] == "low"].index) == set(b.loc[b["half"] == "low"].index)
    groups = reports["draft"].groups
    for h in ("low", "high"):  # every budget uses the run's one split
        n = groups[groups["group"] == f"entropy/{h}"].groupby("budget")["prompts"].first()
        assert n.nunique() == 1


def test_break_even_tau_is_the_round_cost_in_target_only_tokens():
    """Rounds of 30 ms in all against target-only at 100 tok/s (10 ms a token): a round
    pays for itself when it yields 3 tokens."""
    rounds = pd.DataFrame({"prompt_id": ["a"] * 2, "task": "t", "tau": [2, 4], "accepted": 0,
                           "tree_size": 1, "scored": 1, "root_entropy": 1.0,
                           **{f"ms_{s}": [30.0 / len(STAGES)] * 2 for s in STAGES}})  # fmt: skip
    prompts = pd.DataFrame({"prompt_id": ["a"], "task": ["t"], "tokens": [6], "ms": [60.0],
                            "passes": [2], "baseline_ms": [60.0], "baseline_tokens": [6]})  # fmt: skip
    m = group_metrics(rounds, prompts, 10, 0)
    assert m["break_even_tau"] == pytest.approx(3.0)
    assert m["speedup"] == pytest.approx(1.0)
