"""bench.offline_online: its held-out subset (as many prompts per task, categories in turn)."""

from __future__ import annotations

from collections import Counter

from bench.offline_online import heldout_subset


def test_the_subset_spreads_over_tasks_and_categories():
    ten = heldout_subset(10)
    assert len(ten) == len({p.id for p in ten}) == 10
    assert set(Counter(p.task for p in ten).values()) == {2}  # five tasks, two each
    mt = [p for p in ten if p.task == "mt_bench"]
    assert len({p.category for p in mt}) == 2  # round-robin over mt_bench's categories
    seven = Counter(p.task for p in heldout_subset(7))
    assert sorted(seven.values()) == [1, 1, 1, 2, 2] and sum(seven.values()) == 7
