"""`bench.bench_drafters` on the shipped pocket drafters at debug size (issue 29.5): the shapes
each kind can draft at the paper's budgets, and the invariants of its tables. Timings are
never asserted; greedy losslessness is checked by the bench itself (it stops otherwise)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

import bench.drafters as drafters
from bench.bench_drafters import elasticity_text, load_kind, main, max_depth, parse_args
from bench.common import suite_prompts
from bench.drafters import Variant, decode_law, tau_versus, variants
from specrank.store.trace_schema import trace_store
from tests.tiny_models import one_thread


def test_shapes_follow_the_papers_triples_and_a_block_chain_stops_at_its_block():
    chain8, tree16 = Variant("eagle3", "chain", "1|0", 8), Variant("block", "tree", "1|1", 16)
    assert chain8.triple() == "7/1/8" and tree16.triple() == "8/10/16"
    s = chain8.settings(32)
    assert s.base.select.budget == 7 and s.base.pool.top_k == 1 and s.base.pool.expand_steps == 6
    assert (s.base.decode.temperature, s.base.decode.draft_temperature) == (1.0, 0.0)
    chosen, skipped = variants(["eagle3", "block"], ["tree", "chain"], ["0|0"], [8, 16],
                               {"block": 8})  # fmt: skip
    assert Variant("block", "chain", "0|0", 16) not in chosen
    assert Variant("eagle3", "chain", "0|0", 16) in chosen and len(chosen) == 7
    assert skipped == ["block/chain at B=16: depth 15 > its 8 (the positions a block drafts)"]
    both = ("exhaustive", "coupling")
    sampled, _ = variants(["block"], ["tree", "chain"], ["1|0", "1|1"], [8], {"block": 8}, both)
    # coupling only where the chain is drawn (T_d > 0); a tree keeps the default verifier
    assert sorted(v.label + " " + v.pair for v in sampled) == [
        "block/chain 1|0", "block/chain 1|1", "block/chain+coupling 1|1", "block/tree 1|0",
        "block/tree 1|1"]  # fmt: skip
    coupled = next(v for v in sampled if v.verifier == "coupling")
    assert coupled.settings(8).base.decode.verifier == "coupling"


def _timings(per_prompt: dict[str, list[int]]) -> list:
    """Prompts whose rounds emit the given token counts (what `tau_versus` reads)."""
    return [SimpleNamespace(prompt_id=pid, run=SimpleNamespace(
        rounds=[SimpleNamespace(emitted=[0] * n) for n in counts]))
        for pid, counts in per_prompt.items()]  # fmt: skip


@pytest.mark.parametrize("kind", ["block", "dspark", "domino"])
def test_a_block_kind_s_chain_stops_where_its_block_does(kind):
    """The shipped block and semi-AR drafters draft depth 8 (DSpark: block_size 8 rows;
    Domino and DFlash: 9 positions after the root): B = 16's chain is skipped for each."""
    depth = max_depth(load_kind(kind, "cpu", "float32"))
    assert depth == 8
    chosen, skipped = variants([kind], ["chain"], ["0|0"], [8, 16], {kind: depth})
    assert [v.budget for v in chosen] == [8] and len(skipped) == 1


def test_tau_against_a_kind_is_paired_on_the_same_prompts():
    """tau = tokens per round over all rounds; ratio and difference against the base kind at
    the same shape, pair and budget, the point inside its paired interval; no base, no row."""
    block, dspark = Variant("block", "tree", "0|0", 8), Variant("dspark", "tree", "0|0", 8)
    timings = {block: _timings({"a": [1, 2], "b": [1, 1, 1]}),
               dspark: _timings({"a": [4], "b": [3, 3]}),
               Variant("dspark", "chain", "0|0", 8): _timings({"a": [2]})}  # fmt: skip
    table = tau_versus(timings, "block", 200)
    assert len(table) == 1
    r = table.iloc[0]
    assert (r["kind"], r["tau"], r["base_tau"]) == ("dspark", 10 / 3, 6 / 5)
    assert r["tau_ratio"] == pytest.approx((10 / 3) / (6 / 5))
    assert r["tau_diff"] == pytest.approx(10 / 3 - 6 / 5)
    for q in ("tau_ratio", "tau_diff"):
        assert r[f"{q}_lo"] <= r[q] <= r[f"{q}_hi"]
    assert tau_versus(timings, "eagle3", 10).empty


def test_kinds_shapes_and_pairs_decode_and_the_tables_hold_their_identities(tmp_path):
    with one_thread():
        out = main(["--prompts", "2", "--max-new-tokens", "8", "--budgets", "4", "8",
                    "--kinds", "eagle3", "dcore",
                    "--pairs", "0|0", "1|1", "--offline-prompts", "0", "--resamples", "50",
                    "--out", str(tmp_path / "d.json")])  # fmt: skip
    assert (tmp_path / "d.json").exists()
    groups = [g for g in out["groups"] if g["group"] == "all"]
    # 2 kinds (a head, a block drafter) x (2 shapes x 2 pairs + a coupled 1|1 chain) x 2
    # budgets: every chain fits the block drafter's depth 8 (every kind: the bench's own run)
    assert len(groups) == 20 and not out["skipped"]
    assert sum(g["shape"] == "chain+coupling" for g in groups) == 2 * 2
    for g in groups:
        drafted = g["budget"] - 1
        assert 1.0 <= g["tau"] <= drafted + 1  # a round commits its accepted nodes + 1
        # the point inside its interval (to rounding: two prompts resample to the point itself)
        assert g["speedup_lo"] - 1e-9 <= g["speedup"] <= g["speedup_hi"] + 1e-9
        split = sum(v for k, v in g.items() if k.startswith("ms/"))
        assert split > 0
    assert len(out["elasticity"]) == 2 * 5  # kind x (shape, pair), coupled chain too, B = 4 -> 8
    for e in out["elasticity"]:
        assert e["from_budget"] == 4 and e["to_budget"] == 8
        assert np.isclose(e["d_ln_tps"], e["d_ln_tau"] + e["d_ln_eta"])
    assert {h["half"] for h in out["halves"]} == {"low", "high"}


def test_a_greedy_divergence_stops_a_float32_run_and_is_counted_otherwise(monkeypatch):
    """bf16 may flip a near-tied argmax between a tree pass and one-token steps: there the
    bench keeps each decode's agreement instead of stopping (here a baseline made to differ)."""
    real = drafters.timed_baseline

    def shifted(*args, **kwargs):
        out, ms = real(*args, **kwargs)
        return [out[0] + 1, *out[1:]], ms

    monkeypatch.setattr(drafters, "timed_baseline", shifted)
    pairs = {"eagle3": load_kind("eagle3", "cpu", "float32")}
    prompts, _ = suite_prompts(1, 0)
    law = [Variant("eagle3", "tree", "0|0", 4)]
    with one_thread():
        with pytest.raises(AssertionError, match="differs from target-only"):
            decode_law(pairs, prompts, law, 4, warmup=0)
        timings = decode_law(pairs, prompts, law, 4, warmup=0, exact=False)
    assert [t.greedy_match for t in timings[law[0]]] == [False]


@pytest.mark.slow
def test_the_offline_half_fits_rerankers_on_a_kinds_own_traces(tmp_path, monkeypatch):
    import bench.bench_drafters as B

    monkeypatch.setattr(B, "CACHE", tmp_path / "cache")
    with one_thread():
        out = main(["--prompts", "2", "--max-new-tokens", "12", "--kinds", "block",
                    "--shapes", "tree", "--pairs", "0|0", "--offline-prompts", "8",
                    "--resamples", "50"])  # fmt: skip
    rows = out["offline"]
    assert {r["law"] for r in rows} == {"greedy", "sampling"}
    assert {r["budget"] for r in rows} == {7, 15}  # drafted nodes at the paper's B = 8, 16
    assert {r["pair"] for r in rows} == {"0|0", "1|0"}
    assert all(r["gain_lo"] - 1e-9 <= r["gain"] <= r["gain_hi"] + 1e-9 for r in rows)
    (store,) = (tmp_path / "cache").glob("block-8x12-*")  # kind, prompts x tokens, their ids
    assert (store / "features" / "manifest.json").exists()


@pytest.mark.slow
def test_the_offline_half_runs_alone_on_a_semi_ar_kind(tmp_path, monkeypatch):
    """`--prompts 0`: no online decoding, the rerankers fitted on DSpark's own traces (the
    manifest names the kind), rows_lgbm's gain over draft at B = 8 for both laws."""
    import bench.bench_drafters as B

    monkeypatch.setattr(B, "CACHE", tmp_path / "cache")
    with one_thread():
        out = main(["--prompts", "0", "--kinds", "dspark", "--offline-prompts", "8",
                    "--max-new-tokens", "12", "--budgets", "8", "--resamples", "50"])  # fmt: skip
    assert "groups" not in out and not out["skipped"]
    rows = [r for r in out["offline"] if r["rule"] == "rows_lgbm"]
    assert sorted((r["kind"], r["law"], r["budget"]) for r in rows) == [
        ("dspark", "greedy", 7), ("dspark", "sampling", 7)]  # fmt: skip
    (store,) = (tmp_path / "cache").glob("dspark-8x12-*")
    assert trace_store(store / "traces").manifest()["models"]["drafter_kind"] == "dspark"


def test_neither_half_is_refused():
    with pytest.raises(SystemExit):
        parse_args(["--prompts", "0", "--offline-prompts", "0"])


def test_one_budget_says_why_there_is_no_elasticity():
    # the 2026-12-05 GPU lease ran --budgets 8 and printed the section's header alone
    assert "each drafter ran at one budget" in elasticity_text(pd.DataFrame())
