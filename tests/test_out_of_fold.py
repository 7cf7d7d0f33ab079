"""Cross-fitting halves: even/odd only when balanced within every task, else seeded and stratified."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hydra import compose

from pairs.prompts import load_prompts
from rerank.config import RerankConfig
from rerank.fit.folds import check_grouped
from rerank.fit.halves import balance_tolerance, fold_map, halves_table, prompt_halves
from tests.test_tasks import _data


def _counts(ids, tasks, folds) -> dict[str, tuple[int, int]]:
    """(prompts in half 0, prompts in half 1) per task, counted by hand from the rows."""
    seen: dict[str, dict[str, int]] = {}
    for pid, task, f in zip(ids, tasks, folds, strict=True):
        seen.setdefault(task, {})[pid] = int(f)
    return {
        t: (sum(v == 0 for v in m.values()), sum(v == 1 for v in m.values()))
        for t, m in seen.items()
    }


def test_tolerance_is_one_prompt_or_a_tenth_of_the_task():
    assert [balance_tolerance(n) for n in (1, 2, 9, 19, 20, 80, 164)] == [1, 1, 1, 1, 2, 8, 16]


def test_unbalanced_even_odd_is_refused_with_the_counts():
    # The default suite's shape: HumanEval/0-5 (coding) and ShareGPT ids that all end in _0.
    ids = [f"HumanEval/{i}" for i in range(6)] + [f"sharegpt/x{i}_0" for i in range(6)]
    tasks = ["coding"] * 6 + ["mt_bench", "mt_bench", "qa", "qa", "coding", "mt_bench"]
    # coding: HumanEval 0, 2, 4 and one ShareGPT even, HumanEval 1, 3, 5 odd -> 4/3 (ok);
    # mt_bench 3/0 and qa 2/0 exceed max(1, n // 10) = 1.
    with pytest.raises(ValueError) as err:
        prompt_halves(np.array(ids), "even_odd", tasks=np.array(tasks))
    msg = str(err.value)
    assert "coding 4/3" in msg and "mt_bench 3/0" in msg and "qa 2/0" in msg
    assert "unbalanced: ['mt_bench', 'qa']" in msg and "seeded" in msg


def test_even_odd_tolerance_boundary():
    tasks = np.array(["t"] * 20)
    ok = np.array([f"p-{2 * i}" for i in range(11)] + [f"p-{2 * i + 1}" for i in range(9)])
    folds = prompt_halves(ok, "even_odd", tasks=tasks)  # 11/9: |2| <= 20 // 10
    assert np.bincount(folds).tolist() == [11, 9]
    bad = np.array([f"p-{2 * i}" for i in range(12)] + [f"p-{2 * i + 1}" for i in range(8)])
    with pytest.raises(ValueError, match=r"t 12/8.*unbalanced: \['t'\]"):
        prompt_halves(bad, "even_odd", tasks=tasks)


def test_paper_ids_are_balanced_under_even_odd(hydra_conf):
    prompts = load_prompts(_data("paper"))
    ids = np.array([p.id for p in prompts])
    tasks = np.array([str(p.task) for p in prompts])
    folds = prompt_halves(ids, "even_odd", tasks=tasks)
    # Spec-Bench numbers its tasks in runs of 80 from 81 (40 even, 40 odd each);
    # HumanEval/0-163 has 82 of each.
    expect = {t: (40, 40) for t in set(tasks) - {"coding"}} | {"coding": (82, 82)}
    assert _counts(ids, tasks, folds) == expect


def test_seeded_split_is_stratified_by_task_hand_case():
    ids = np.array(["a1", "a2", "a3", "a4", "b1", "b2", "b3", "c1"])
    tasks = np.array(["a"] * 4 + ["b"] * 3 + ["c"])
    for seed in range(20):
        folds = prompt_halves(ids, "seeded", seed=seed, tasks=tasks)
        counts = _counts(ids, tasks, folds)
        assert counts["a"] == (2, 2)
        assert sorted(counts["b"]) == [1, 2] and sorted(counts["c"]) == [0, 1]
        # b's extra prompt and c's go to different halves: 4 and 4 overall
        assert np.bincount(folds).tolist() == [4, 4]


def test_seeded_split_never_splits_a_prompt_and_ignores_row_order():
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 40, 600)
    ids = np.array([f"q{i}" for i in prompt])
    tasks = np.array(["x", "y", "z"])[prompt % 3]
    folds = prompt_halves(ids, "seeded", seed=7, tasks=tasks)
    check_grouped(ids, folds)
    for n0, n1 in _counts(ids, tasks, folds).values():
        assert abs(n0 - n1) <= 1
    perm = rng.permutation(ids.size)
    again = prompt_halves(ids[perm], "seeded", seed=7, tasks=tasks[perm])
    assert dict(zip(ids[perm], again, strict=True)) == dict(zip(ids, folds, strict=True))


def test_seeded_split_is_deterministic_under_a_seed():
    ids = np.array([f"q{i}" for i in range(30)])
    tasks = np.array(["x", "y"] * 15)
    first = prompt_halves(ids, "seeded", seed=3, tasks=tasks)
    np.testing.assert_array_equal(first, prompt_halves(ids, "seeded", seed=3, tasks=tasks))
    others = [prompt_halves(ids, "seeded", seed=s, tasks=tasks) for s in range(4, 8)]
    assert any(not np.array_equal(first, o) for o in others)  # the seed matters


def test_a_prompt_with_two_tasks_is_refused():
    with pytest.raises(ValueError, match=r"more than one task, e.g. \['p1'\]"):
        prompt_halves(np.array(["p1", "p1", "p2"]), "seeded", tasks=np.array(["a", "b", "a"]))


def test_fold_map_stratifies_and_halves_table_counts_prompts_and_rounds():
    # p1, p2 (task a) with 2 and 1 rounds; p3, p4 (task b) with 1 round each; two
    # candidate rows per round (the table counts rounds, not rows).
    rounds = [("p1", "a", 0), ("p1", "a", 1), ("p2", "a", 0), ("p3", "b", 0), ("p4", "b", 0)]
    frame = pd.DataFrame(
        [
            {
                "prompt_id": p,
                "task": t,
                "temperature": 0.0,
                "rule": "draft",
                "budget": 8,
                "round_index": r,
                "cand_index": c,
            }
            for p, t, r in rounds
            for c in (0, 1)
        ]
    )
    folds = fold_map(frame["prompt_id"].to_numpy(), "seeded", 0, frame["task"].to_numpy())
    assert folds["p1"] != folds["p2"] and folds["p3"] != folds["p4"]  # one of each per half
    table = halves_table(frame, folds)
    h1 = folds["p1"]  # p1's half holds 2 task-a rounds, the other 1
    assert table.loc["a", f"rounds_{h1}"] == 2 and table.loc["a", f"rounds_{1 - h1}"] == 1
    assert table.loc["a", ["prompts_0", "prompts_1"]].tolist() == [1, 1]
    assert table.loc["b"].tolist() == [1, 1, 1, 1]
    assert table.loc["all"].tolist() == [2, 2, *sorted([3, 2], reverse=h1 == 0)]


def test_default_is_seeded_and_the_paper_keeps_even_odd(hydra_conf):
    assert RerankConfig().halves == "seeded"
    assert compose("train").rerank.halves == "seeded"
    assert compose("train", overrides=["experiment=paper"]).rerank.halves == "even_odd"


def test_default_suite_refuses_even_odd_and_splits_seeded(hydra_conf):
    prompts = load_prompts(_data("default"))
    ids = np.array([p.id for p in prompts])
    tasks = np.array([str(p.task) for p in prompts])
    with pytest.raises(ValueError, match="unbalanced"):
        prompt_halves(ids, "even_odd", tasks=tasks)
    folds = prompt_halves(ids, "seeded", seed=0, tasks=tasks)
    assert all(abs(n0 - n1) <= 1 for n0, n1 in _counts(ids, tasks, folds).values())
