"""Realized acceptance online agrees with the rule's offline expected value on the same contexts.

The run records its rounds (run.score=record); `selection.values.evaluate_pools`
then values the rule that chose each round's tree on that round's own pool and
rows (the reranker with the round's own log phat). Greedy: equal round by round
(one target pass gives both the traversal and the recorded argmaxes, so not even
rounding can separate them). Sampling: the round-weighted mean of realized minus
expected lies inside its 99.9% paired prompt-bootstrap interval (2,000 resamples),
so a correct decoder fails about once in a thousand runs per rule, like the
chi-square tests (seeds fixed, so the outcome is reproducible).
"""

from __future__ import annotations

import numpy as np
import pytest

from decode.loop import decode_prompt
from decode.metrics import PromptTiming, expected_values, realized_vs_expected, round_table
from pairs.prompts import encode_prompt
from rerank.serving import OnlinePredictor, load_online_reranker
from tests.online_fixtures import PROMPTS, fitted_reranker, settings
from tests.tiny_models import one_thread, tiny_pair

RULES = ["draft", "reranker", "root", "root_draw", "pearl"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with one_thread():
        yield tiny_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def predictors(pair, tmp_path_factory):
    out = {}
    with one_thread():
        for t in (0.0, 1.0):
            path = fitted_reranker(tmp_path_factory.mktemp(f"rr{t:g}"), pair, t)
            out[t] = OnlinePredictor(load_online_reranker(str(path), t, "unused"), pair.device)
    return out


def _run(pair, predictor, rule: str, temperature: float, budget: int, prompts, max_new: int):
    s = settings(
        rule, temperature, budget=budget, score="record", record=True, max_new_tokens=max_new
    )
    timings = []
    with one_thread():
        for p in prompts:
            ids = encode_prompt(pair.tokenizer, p.text)
            r = decode_prompt(
                pair.target, pair.drafter, ids, s, frozenset(), p.id, p.task, predictor
            )
            timings.append(PromptTiming(p.id, p.task, r, 0, 0.0))
    rounds = round_table(timings)
    rows = [x.fields for t in timings for x in t.run.rounds]
    firsts = [x.first_logprob for t in timings for x in t.run.rounds]
    rounds["expected"] = expected_values(rows, rule, budget, firsts)
    return rounds


@pytest.mark.parametrize("budget", [2, 6])
@pytest.mark.parametrize("rule", RULES)
def test_greedy_realized_equals_expected_round_by_round(pair, predictors, rule, budget):
    rounds = _run(pair, predictors[0.0], rule, 0.0, budget, PROMPTS[:3], 32)
    np.testing.assert_array_equal(rounds["accepted"].to_numpy(), rounds["expected"].to_numpy())
    assert rounds["accepted"].mean() > 0.5  # trees are accepted into, so the check has power


# draft and root are covered by the greedy test and by `-m slow` here (~4 s each).
SAMPLED = [
    "reranker",
    "root_draw",
    "pearl",
    *(pytest.param(r, marks=pytest.mark.slow) for r in ("draft", "root")),
]


@pytest.mark.parametrize("rule", SAMPLED)
def test_sampled_realized_mean_is_inside_the_bootstrap_interval(pair, predictors, rule):
    rounds = _run(pair, predictors[1.0], rule, 1.0, 6, PROMPTS, 48)
    v = realized_vs_expected(rounds, n_resamples=2000, seed=0, level=0.999)
    assert len(rounds) > 150
    assert v["realized_minus_expected_lo"] <= 0.0 <= v["realized_minus_expected_hi"], v
    assert v["rounds_equal"] < 1.0  # sampled: rounds differ, only the means agree
