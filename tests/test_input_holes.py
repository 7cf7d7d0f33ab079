"""The last input holes (issue 30): each one refused by name, never read as a value.

Budgets past the store's pool, null list items, undefined bootstrap resamples, the NaN
message, and a protocol-4 head checkpoint.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

import rerank.train as train_module
from features.extract import extract
from pairs.eagle3.layout import pickle_protocol, read_head_weights
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import BoosterConfig, RerankConfig
from rerank.evaluate.values import EvalPlan, evaluate_traces
from rerank.report.summary import _node_budgets, results_table, summarise_draws
from selection.pool_batch import check_draft_logprobs, list_matrix, pool_batch_from_table
from specrank.settings.config import MlflowConfig
from specrank.statistics.bootstrap import MAX_NONFINITE_SHARE, ci_text, percentile_interval
from specrank.store.tables import SchemaError, sha256_file
from specrank.store.trace_schema import TRACE_SPEC, trace_store
from tree.config import PoolConfig, SelectConfig

POOL = PoolConfig(top_k=4, expand_steps=2, expand=4)  # 4 + 16 + 16 = 36 candidates
N_POOL = 36


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("holes")
    job = SynthJobConfig(toy_prompts=4, rounds_per_prompt=3, prompts_per_shard=2)
    write_synthetic_traces(root / "traces", job, POOL, SelectConfig(budget=8), SynthConfig(), 0)
    extract(root / "traces", root / "features", log=lambda _: None)
    return root / "traces", root / "features"


def _rerank(stores, **kw) -> RerankConfig:
    traces, features = stores
    base = RerankConfig(traces=str(traces), features=str(features),
                        booster=BoosterConfig(n_threads=1), n_resamples=20)  # fmt: skip
    return replace(base, **kw)


@pytest.fixture()
def no_fits(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a reranker was fitted before the budgets were checked")

    monkeypatch.setattr(train_module, "fit_rerankers", refuse)


# -- 1. rerank.budgets bounded by the store's pool (and by rerank.draft_top_m) --------------------------


def test_a_budget_past_the_pool_is_refused_naming_both(stores, no_fits, tmp_path):
    rerank = _rerank(stores, budgets=[8, 100000])
    msg = rf"'rerank.budgets' must be at most {N_POOL}, the pool size {N_POOL} of .*traces.*\[100000\]"
    with pytest.raises(ValueError, match=msg):
        train_module.train_and_evaluate(rerank, MlflowConfig(), {}, 0, tmp_path / "out")


def test_a_budget_past_top_m_is_refused_naming_both(stores, no_fits, tmp_path):
    rerank = _rerank(stores, budgets=[8], draft_top_m=5)
    msg = rf"'rerank.budgets' must be at most 5, rerank.draft_top_m=5 \(the pool holds {N_POOL}\)"
    with pytest.raises(ValueError, match=msg):
        train_module.train_and_evaluate(rerank, MlflowConfig(), {}, 0, tmp_path / "out")


def test_sweep_budgets_past_the_pool_are_left_out_and_logged(stores, caplog):
    from rerank.settings import store_budgets

    with caplog.at_level(logging.WARNING, logger="rerank.settings"):
        budgets = store_budgets(_rerank(stores, budgets=[8], sweep=True))
    assert budgets == [2, 4, 8, 12, 16, 24, 32]
    assert "budgets [48, 59, 80, 100, 150, 200] left out" in caplog.text


# -- 2. null list items are refused wherever the schema declares none ------------------------------


def _with_null(table: pa.Table, name: str, row: int, item: int) -> pa.Table:
    """`table` with item `item` of row `row` of list column `name` set to null."""
    values = table[name].to_pylist()
    values[row][item] = None
    i = table.schema.get_field_index(name)
    return table.set_column(
        i, table.schema.field(name), pa.array(values, table.schema.field(name).type)
    )


@pytest.mark.parametrize(
    "name", ["cand_draft_logprob", "cand_parent", "cand_depth", "cand_target_prob", "cand_token"]
)
def test_a_null_pool_item_is_refused_by_the_library_evaluator(stores, name):
    table = _with_null(trace_store(stores[0]).read(), name, 2, 5)
    with pytest.raises(ValueError, match=rf"{name}: 1 null item\(s\) \(row 2 item 5\)"):
        evaluate_traces(ds.dataset(table), EvalPlan([4]))


def test_a_null_item_written_by_pandas_is_refused(stores):
    frame = trace_store(stores[0]).read().to_pandas()
    frame.at[1, "cand_draft_logprob"] = np.where(
        np.arange(N_POOL) == 7, np.nan, frame.at[1, "cand_draft_logprob"]
    )
    table = pa.Table.from_pandas(frame, preserve_index=False)  # NaN inside a list -> null
    with pytest.raises(ValueError, match=r"cand_draft_logprob: 1 null item\(s\) \(row 1 item 7\)"):
        pool_batch_from_table(table)


def test_argmax_lists_narrower_than_the_pools_are_refused(stores):
    frame = trace_store(stores[0]).read().to_pandas()
    frame["cand_target_argmax"] = [a[:-1] for a in frame["cand_target_argmax"]]
    with pytest.raises(ValueError, match=r"cand_target_argmax: pools of 35 columns, but cand_"):
        pool_batch_from_table(pa.Table.from_pandas(frame, preserve_index=False))


def test_null_first_level_rows_stay_allowed(stores):
    """An absent retained row is a declared null: the same pool reads as before."""
    table = trace_store(stores[0]).read()
    assert table["fl_matched_logprob"].combine_chunks().flatten().null_count > 0
    out = evaluate_traces(ds.dataset(table), EvalPlan([4], substitutions=["cache"]))
    assert np.isfinite(out["sub_cache@B4"]).all()


def test_writers_refuse_a_null_item(stores):
    table = _with_null(trace_store(stores[0]).read(), "cand_token", 0, 0)
    with pytest.raises(SchemaError, match=r"cand_token holds 1 null list item\(s\)"):
        TRACE_SPEC.conform(table)


def test_extract_refuses_a_null_pool_item(stores, tmp_path):
    """A shard whose items were declared nullable (as v3 stores before the item declarations
    were), written past the store's own check, holding a null: extract refuses it."""
    src = trace_store(stores[0])
    out = trace_store(tmp_path / "traces")
    out.open_for_writing(src.manifest()["config"], src.manifest()["models"])
    path = out.root / "shard-00000.parquet"
    table = src.read()
    old = pa.schema([f.with_type(pa.list_(f.type.value_type)) if pa.types.is_list(f.type) else f
                     for f in table.schema], metadata=table.schema.metadata)  # fmt: skip
    pq.write_table(_with_null(table.cast(old), "cand_depth", 0, 3), path)
    marker = {"rows": pq.read_metadata(path).num_rows, "sha256": sha256_file(path)}
    (out.root / "shard-00000.done").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"cand_depth: 1 null item"):
        extract(out.root, tmp_path / "features", log=lambda _: None)


def test_a_null_list_is_refused():
    col = pa.array([[1.0], None], pa.list_(pa.float32()))
    with pytest.raises(ValueError, match=r"x: 1 null list\(s\), at rows \[1\]"):
        list_matrix(col, 0.0, np.float32, name="x")


# -- 4. intervals count their undefined resamples ---------------------------------------------------


def test_an_interval_reports_its_non_finite_resamples():
    draws = np.arange(100, dtype=float)
    draws[:3] = np.nan  # 3%: under the limit, so the interval stands with the count beside it
    iv = percentile_interval(1.0, draws)
    assert (iv.nonfinite, iv.resamples, iv.reason) == (3, 100, "")
    assert iv.low == pytest.approx(np.percentile(draws[3:], 2.5))
    draws[:6] = np.inf  # 6% > 5%: the finite ones would describe another statistic
    iv = percentile_interval(1.0, draws, undefined="beyond the pool")
    assert np.isnan(iv.low) and np.isnan(iv.high) and iv.nonfinite == 6
    assert iv.reason == "6 of 100 resamples beyond the pool (over 5%)"
    assert MAX_NONFINITE_SHARE == 0.05
    assert iv.columns("gain")["gain_note"] == iv.reason
    assert ci_text(0.049, iv.low, iv.high) == "  +4.9% [n/a]"


def test_an_unreachable_node_budget_is_beyond_the_pool():
    curve = np.array([[1.0, 2.0, 3.0]])  # draft's mean value at budgets 1..3
    draws = np.array([1.5] * 97 + [5.0] * 3)
    out = _node_budgets(curve, np.repeat(curve, 100, 0), 4.0, draws, "node_budget")
    assert np.isnan(out["node_budget"]) and out["node_budget_note"].startswith("beyond the pool")
    reach = _node_budgets(curve, np.repeat(curve, 100, 0), 1.5, draws, "node_budget")
    assert reach["node_budget"] == 2 and reach["node_budget_nonfinite"] == 3
    assert reach["node_budget_note"] == ""


def test_the_results_table_prints_why_an_interval_is_missing():
    from rerank.report.summary import LawDraws

    point = np.array([1.0, 1.2])
    draws = np.stack([np.ones(100), np.r_[np.full(90, 1.2), np.full(10, np.nan)]], 1)
    d = LawDraws(0.0, "round", ["draft@B8", "x@B8"], point, draws, 10, 5, {})
    table = results_table(summarise_draws([d]))
    assert "+20.0% [n/a]" in table
    assert "x at B=8: no gain interval, 10 of 100 resamples undefined (over 5%)" in table


# -- 5. the NaN message shows the offending entries -------------------------------------------------


def test_the_nan_message_shows_the_offending_positions():
    col = pa.array([[-1.0, -2.0], [-0.5, float("nan"), -3.0]], pa.list_(pa.float32()))
    with pytest.raises(ValueError, match=r"1 value\(s\) are NaN.*\(row 1 pool index 1: nan\)"):
        check_draft_logprobs(col)


# -- 8. a protocol-4 checkpoint is refused with its cause and remedy -------------------------------


@pytest.mark.parametrize("zip_format", [True, False])
def test_a_protocol_4_bin_is_refused_by_its_cause(tmp_path, zip_format):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"fc.weight": torch.zeros(2, 2)}, path, pickle_protocol=4,
               _use_new_zipfile_serialization=zip_format)  # fmt: skip
    assert pickle_protocol(path) == 4
    with pytest.raises(ValueError, match=r"pickle protocol 4.*cannot read.*re-save.*safetensors"):
        read_head_weights(tmp_path)
    torch.save({"fc.weight": torch.zeros(2, 2)}, path, _use_new_zipfile_serialization=zip_format)
    assert pickle_protocol(path) == 2
    assert set(read_head_weights(tmp_path)[0]) == {"fc.weight"}
