"""`bench.bench_scored` on the tiny pair: one greedy output under every scored-set policy,
and the scored prefixes each policy names (issue 28.1). Timings are never asserted."""

from __future__ import annotations

from bench.bench_scored import bench_scored, policies
from tests.online_fixtures import PROMPTS, SMALL_POOL, settings
from tests.tiny_models import one_thread, tiny_pair
from tree.pool import pool_size


def test_every_policy_decodes_the_same_tokens_and_scores_its_prefixes(tmp_path):
    pair = tiny_pair(tmp_path / "pair", "llama")
    base = settings(budget=6).base
    with one_thread():
        table = bench_scored(pair, PROMPTS[:2], base, [4, 8]).set_index("policy")
    assert list(table.index) == [p[0] for p in policies([4, 8])]
    # the extra prefixes ride in the tree pass: the same rounds, the same tokens per round
    assert table["rounds"].nunique() == 1 and table["tau"].nunique() == 1
    n = pool_size(SMALL_POOL)
    assert table.loc["tree", "scored_prefixes"] == 6  # the tree beside the root
    assert table.loc["top_m4", "scored_prefixes"] == table.loc["tree", "scored_prefixes"] + 4
    assert table.loc["top_m8", "scored_prefixes"] == table.loc["tree", "scored_prefixes"] + 8
    assert table.loc["pool", "scored_prefixes"] == n
    assert table.loc["tree", "verify_over_tree"] == 1.0
