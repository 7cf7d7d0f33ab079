"""The online decoder keeps the target's output law under every selection rule.

1. Greedy: every rule (draft, reranker, root, root-draw, PEARL, covering), scoring the
   tree alone or the recorder's scored set, emits exactly the target's greedy output.
2. rule=draft with run.score=record is the recorder's round (`decode.stream`): the
   same output and the same trace rows, greedy and sampled (same seeds).
3. Sampling: on a tiny-vocabulary model the first two emitted tokens follow
   p(x1 | c) p(x2 | c x1) under every rule: Pearson's chi-square as in
   tests/test_decode_sampling.py (cells with expected count >= 5, the rest merged),
   failing below p = 1e-3 (a correct decoder fails about once in a thousand; seeds fixed).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from decode.settings import OnlineSettings
from pairs.prompts import encode_prompt
from rerank.fit.models import fit_reranker
from rerank.serving import OnlinePredictor
from selection.policies import SCORE_MODES
from selection.rules import online_rules
from tests.candidate_frames import FAST, make_candidate_frame
from tests.online_fixtures import PROMPTS, SMALL_POOL, fitted_reranker, settings, tiny_vocab_models
from tests.test_decode_sampling import ALPHA, PROMPT, TINY_V, _chi_square_p, _exact_two_token_law
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair
from tree.config import PoolConfig
from tree.pool import pool_size

TEXTS = [PROMPTS[0], PROMPTS[1]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with one_thread():
        yield tiny_pair(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def greedy_predictor(pair, tmp_path_factory):
    with one_thread():
        path = fitted_reranker(tmp_path_factory.mktemp("rr"), pair, 0.0)
    from rerank.serving import load_online_reranker

    return OnlinePredictor(load_online_reranker(str(path), 0.0, "unused"), pair.device)


def _check_greedy(pair, s: OnlineSettings, predictor=None) -> list:
    runs = []
    for p in TEXTS:
        ids = encode_prompt(pair.tokenizer, p.text)
        r = decode_prompt(pair.target, pair.drafter, ids, s, frozenset(), p.id, p.task, predictor)
        assert r.output == autoregressive_decode(pair.target, ids, len(r.output))
        assert sum(len(x.emitted) for x in r.rounds) == len(r.output)  # tau = accepted + 1
        assert all(x.n_accepted + 1 == len(x.emitted) for x in r.rounds)
        assert all(1 <= x.passes + int(x.passes == 0) <= 2 for x in r.rounds)
        runs.append(r)
    return runs


@pytest.mark.parametrize("score", SCORE_MODES)
@pytest.mark.parametrize("rule", online_rules())
def test_greedy_output_equals_the_targets(pair, greedy_predictor, rule, score):
    if rule == "covering" and score != "tree":
        pytest.skip("the covering decoder scores its tree only")
    predictor = greedy_predictor if rule == "reranker" else None
    with one_thread():
        runs = _check_greedy(pair, settings(rule, score=score), predictor)
    rounds = [x for r in runs for x in r.rounds]
    if score == "tree":  # what each pass scored: the tree alone, or more
        assert all(x.scored == x.tree_size for x in rounds)
    else:
        assert all(x.scored >= x.tree_size for x in rounds)
    if score == "pool":
        assert all(x.scored >= pool_size(SMALL_POOL) for x in rounds)
    if rule in ("root_draw", "pearl"):  # the draw counts as accepted, even off the pool
        assert all(x.n_accepted >= 1 for x in rounds)
    if rule == "covering":  # the held-row path is exercised; every round makes its one pass
        assert any(x.covered for x in rounds) and all(x.passes == 1 for x in rounds)
    if rule == "root":  # its tree pass is skipped when X1 is off the tree's first level
        assert all(x.passes in (1, 2) for x in rounds)
    if rule in ("root_draw", "pearl"):  # X1 off the pool is verified alone: always two passes
        assert all(x.passes == 2 and len(x.emitted) >= 2 for x in rounds)


@pytest.mark.parametrize("rule", ["root_draw", "covering", "reranker"])
def test_greedy_equality_on_qwen3(tmp_path, rule):
    pair = tiny_pair(tmp_path / "q", "qwen3")
    predictor = None
    with one_thread():
        if rule == "reranker":
            from rerank.serving import load_online_reranker

            path = fitted_reranker(tmp_path / "rr", pair, 0.0, kind="hgb", feature_set="base")
            predictor = OnlinePredictor(load_online_reranker(str(path), 0.0, "x"), pair.device)
            assert predictor.route == "compiled"  # auto on a CPU
        _check_greedy(pair, settings(rule, budget=8), predictor)


@pytest.mark.parametrize(("temperature", "verifier"), [(0.0, "exhaustive"), (1.0, "eagle3")])
def test_recording_does_not_change_the_decode(pair, temperature, verifier):
    """Recording (trace rows, retained rows, the token-keyed cache) only reads the pass:
    the same seed gives the same output and accepted lengths with and without it."""
    plain = settings("draft", temperature, score="record", verifier=verifier)
    rec = settings("draft", temperature, score="record", record=True, verifier=verifier)
    ids = encode_prompt(pair.tokenizer, TEXTS[0].text)
    with one_thread():
        ref = decode_prompt(pair.target, pair.drafter, ids, plain, frozenset(), "x", "t")
        got = decode_prompt(pair.target, pair.drafter, ids, rec, frozenset(), "x", "t")
    assert got.output == ref.output
    assert [r.n_accepted for r in got.rounds] == [r.n_accepted for r in ref.rounds]
    assert all(r.fields is None for r in ref.rounds)
    for r in got.rounds:  # each recorded row is the round that was decoded
        path = r.fields["accepted_path"]
        assert [r.fields["cand_token"][i] for i in path] == r.emitted[:-1]
        assert r.fields["continuation_token"] == r.emitted[-1]


def test_bad_settings_are_refused(pair):
    ids = encode_prompt(pair.tokenizer, TEXTS[0].text)
    cases = [
        (settings("typo"), r"'run.rule' must be one of \['draft', 'reranker'"),
        (
            settings("draft", score="all"),
            r"'run.score' must be one of \['tree', 'top_m', 'frontier', 'record', 'pool'\]",
        ),
        (settings("draft", record=True), "run.record_traces=true needs run.score=record"),
        (settings("covering", score="record", record=True), "not supported for run.rule=covering"),
        (settings("reranker"), "run.rule=reranker needs a loaded reranker"),
    ]
    for s, msg in cases:
        with pytest.raises(ValueError, match=msg):
            decode_prompt(pair.target, pair.drafter, ids, s, frozenset())


# -- sampling: the law of the first two tokens ---------------------------------------------------

N_RUNS = 250  # per rule (~3 s each); `-m slow` repeats with 2,000


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    with one_thread():
        target, drafter = tiny_vocab_models(tmp_path_factory.mktemp("tinyv"))
        frame = make_candidate_frame(n_prompts=20, rounds=6, temperature=1.0, seed=2)
        model = fit_reranker(frame, "rows", "lgbm", "sampling", n_threads=1, capacity=FAST)
    yield target, drafter, OnlinePredictor(model, torch.device("cpu"), "forest")


SAMPLING_CASES = [  # (rule, verifier, what a pass scores beside the tree: run.score)
    ("root", "exhaustive", "tree"),
    pytest.param("root_draw", "exhaustive", "tree", marks=pytest.mark.slow),  # eagle3 + pearl
    ("root_draw", "eagle3", "tree"),
    ("pearl", "exhaustive", "tree"),
    ("pearl", "exhaustive", "frontier"),
    ("covering", "exhaustive", "tree"),
    ("reranker", "eagle3", "tree"),
    ("reranker", "exhaustive", "top_m"),  # extra prefixes in the pass leave the law alone
    pytest.param("draft", "exhaustive", "pool", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("n", [N_RUNS, pytest.param(2000, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("rule", "verifier", "score"), SAMPLING_CASES)
def test_sampled_outputs_follow_the_target_law(tiny_vocab, rule, verifier, score, n):
    target, drafter, predictor = tiny_vocab
    s = settings(rule, 1.0, budget=3, max_new_tokens=2, verifier=verifier, score=score, top_m=2)
    s = dataclasses.replace(
        s, base=dataclasses.replace(s.base, pool=PoolConfig(top_k=3, expand_steps=2, expand=2))
    )
    counts = np.zeros((TINY_V, TINY_V))
    accepted = covered = 0
    with one_thread():
        for i in range(n):
            r = decode_prompt(target, drafter, PROMPT, s, frozenset(), f"p{i}", "", predictor)
            counts[r.output[0], r.output[1]] += 1
            accepted += sum(x.n_accepted for x in r.rounds)
            covered += sum(x.covered for x in r.rounds)
    assert accepted > n // 4  # the trees are used
    if rule == "covering":
        assert covered > n // 10  # held rows are used
    p = _chi_square_p(counts.reshape(-1), _exact_two_token_law(target, 1.0).reshape(-1))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("rule", online_rules())
def test_every_rule_on_cuda(tmp_path, rule):
    """Greedy equality and seeded sampling on the device; the reranker's forest runs there."""
    from pairs.models import load_model_pair
    from rerank.serving import load_online_reranker

    cfg = dataclasses.replace(tiny_model_config(tmp_path / "m", "llama"), device="cuda")
    pair = load_model_pair(cfg)
    predictor = {}
    for t in (0.0, 1.0):
        if rule == "reranker":
            path = fitted_reranker(tmp_path / f"rr{t:g}", pair, t, kind="hgb")
            model = load_online_reranker(str(path), t, "x")
            predictor[t] = OnlinePredictor(model, pair.device, "forest")
            assert predictor[t].torch_forest is not None
    _check_greedy(pair, settings(rule, budget=8), predictor.get(0.0))
    s = settings(rule, 1.0, budget=8, max_new_tokens=32, verifier="eagle3")
    ids = encode_prompt(pair.tokenizer, TEXTS[0].text)
    a = decode_prompt(pair.target, pair.drafter, ids, s, frozenset(), "x", "t", predictor.get(1.0))
    b = decode_prompt(pair.target, pair.drafter, ids, s, frozenset(), "x", "t", predictor.get(1.0))
    assert a.output == b.output and all(r.stage_ms[0] > 0 for r in a.rounds)
