"""The drafter's own acceptance estimate in the traces (trace schema v4's `draft_confidence`)
and in the acceptance report (`dspark_confidence`):

- a DSpark drafter records sigmoid(z_1 / T_1) of block row 1 (T_1 from `recipe.json` beside
  it), and every other column of its recording is the same without it; a kind without a
  confidence head (Domino, synthetic traces) records null;
- a v3 store (before the column) reads as v4 with it null, is refused for writing, never
  mixed with v4 shards, and extracts and trains through the pipeline's readers; other
  versions are refused naming the file, the expected and the found version;
- the report evaluates `dspark_confidence` on the `top` set when every round of the law holds
  a value, leaves it out otherwise and says why; the dump carries it and a v1 dump reads as
  v2 with it null.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.bench_acceptance import report as bench_report
from decode.stream import DecodeSettings
from features.extract import extract
from pairs.models import load_causal_lm
from pairs.semiar.drafter import attach_semiar, confidence_temperature, read_semiar, semiar_ids
from rerank.config import BoosterConfig, RerankConfig
from rerank.report.acceptance import DSPARK, law_sets
from rerank.report.acceptance_dump import DUMP_SCHEMA, read_dump
from rerank.report.acceptance_vllm import DSPARK_NOTE
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from specrank.settings.errors import Refusal
from specrank.store.shard_store import MANIFEST
from specrank.store.tables import SchemaError, sha256_file
from specrank.store.trace_schema import SCHEMA_VERSION, TRACE_SCHEMA, trace_store
from tests.recording import decode_recorded
from tests.semiar_drafters import semiar_model_config, write_semiar
from tests.small_jobs import small_stores
from tests.test_acceptance import _frame
from tests.test_decode_sampling import TINY_V
from tests.tiny_models import build_tiny_pair, one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig

PROMPTS = ([1, 5, 3, 6], [2, 2, 7, 0, 4], [6, 1])
T1 = 2.0  # the position-1 temperature of the calibrated copy's recipe.json


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An 8-token target and random DSpark drafters (uncalibrated, calibrated) and Domino."""
    root = tmp_path_factory.mktemp("conf")
    with one_thread():
        build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, layers=7)
        out = {}
        for name, kind in (("dspark", "dspark"), ("domino", "domino")):
            folder = write_semiar(kind, root / name, root / "target", seed=1, init_std=0.6)
            out[name] = folder
        calibrated = root / "dspark_cal"
        shutil.copytree(out["dspark"], calibrated)
        (calibrated / "recipe.json").write_text(json.dumps({"sts": {"temperatures": [T1, 3.0]}}))
        out["dspark_cal"] = calibrated
        cfg = semiar_model_config("dspark", root / "target", out["dspark"])
        target = load_causal_lm(cfg.target, cfg, "model.target")
        drafters = {}
        for name, folder in out.items():
            kind = "domino" if name == "domino" else "dspark"
            c = semiar_model_config(kind, root / "target", folder)
            drafters[name] = attach_semiar(read_semiar(kind, folder, target.config), target, c)
        yield target, drafters


def _record(target, drafter, temperature: float = 0.0) -> list[dict]:
    s = DecodeSettings(pool=PoolConfig(top_k=3, expand_steps=4, expand=3),
                       select=SelectConfig(budget=5),
                       decode=DecodeConfig(max_new_tokens=16, temperature=temperature))  # fmt: skip
    rows = []
    with one_thread():
        for i, prompt in enumerate(PROMPTS):
            rows += decode_recorded(target, drafter, prompt, s, frozenset(), prompt_id=str(i),
                                    record=True).rounds  # fmt: skip
    return rows


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dspark_records_its_calibrated_confidence_and_nothing_else_changes(tiny, temperature):
    target, d = tiny
    plain = _record(target, d["dspark"], temperature)
    calibrated = _record(target, d["dspark_cal"], temperature)
    headless = replace(d["dspark"], module=_without_head(d["dspark"].module))
    none = _record(target, headless, temperature)
    assert plain and len(plain) == len(calibrated) == len(none)
    u = np.array([r["draft_confidence"] for r in plain], np.float64)
    c = np.array([r["draft_confidence"] for r in calibrated], np.float64)
    assert np.isfinite(u).all() and ((u > 0) & (u < 1)).all() and len(np.unique(u)) > 1
    # calibrated: sigmoid(z_1 / T_1) of the same logit z_1 = logit(u)
    assert c == pytest.approx(_sigmoid(np.log(u / (1 - u)) / T1), rel=1e-5)
    assert all(r["draft_confidence"] is None for r in none)
    # every other column is the same with and without it (timings aside: measurements)
    skip = {"draft_confidence", "time_draft_ms", "time_select_ms", "time_verify_ms",
            "time_bookkeeping_ms"}  # fmt: skip
    for a, b, n in zip(plain, calibrated, none, strict=True):
        for k in TRACE_SCHEMA.names:
            if k not in skip and k in a:
                assert a[k] == b[k] == n[k], k
    # the rows are the schema's, the column a float32
    table = pa.Table.from_pylist(plain, schema=TRACE_SCHEMA)
    assert table.schema.field("draft_confidence").type == pa.float32()
    # the manifest says what the column is
    assert f"sigmoid(z_1 / {T1!r})" in semiar_ids(d["dspark_cal"])["draft_confidence"]
    assert "uncalibrated" in semiar_ids(d["dspark"])["draft_confidence"]
    assert (
        d["dspark_cal"].confidence_temperature == T1 and d["dspark"].confidence_temperature is None
    )


def _without_head(module):
    import copy

    out = copy.deepcopy(module)
    del out.confidence_head
    return out


def test_a_kind_without_a_confidence_head_records_null(tiny, tmp_path):
    target, d = tiny
    rows = _record(target, d["domino"])
    assert rows and all(r["draft_confidence"] is None for r in rows)
    assert "draft_confidence" not in semiar_ids(d["domino"])
    stores = small_stores(tmp_path, prompts=4, rounds=3, per_shard=2)
    assert trace_store(stores[0]).read(columns=["draft_confidence"]).column(0).null_count == (
        trace_store(stores[0]).read(columns=["prompt_id"]).num_rows
    )


def test_a_bad_calibration_file_is_refused_by_name(tmp_path):
    assert confidence_temperature(tmp_path) is None  # no recipe.json: uncalibrated
    (tmp_path / "recipe.json").write_text(json.dumps({"config": {}}))
    assert confidence_temperature(tmp_path) is None  # no sts
    (tmp_path / "recipe.json").write_text(json.dumps({"sts": {"temperatures": [0.0]}}))
    with pytest.raises(Refusal, match=r"recipe.json: sts.temperatures: expected a list of "):
        confidence_temperature(tmp_path)
    (tmp_path / "recipe.json").write_text("{")
    with pytest.raises(Refusal, match=r"recipe.json: not valid JSON"):
        confidence_temperature(tmp_path)


def test_the_shipped_pocket_dspark_card_gives_position_1_s_temperature():
    from specrank.settings.paths import PROJECT_ROOT

    folder = PROJECT_ROOT / "models" / "pocket" / "dspark"
    facts = json.loads((folder / "recipe.json").read_text())
    assert confidence_temperature(folder) == facts["sts"]["temperatures"][0]


# -- stores of other versions -------------------------------------------------------------------


def rewrite_store(src: Path, dst: Path, version: int, change=lambda t: t) -> Path:
    """A copy of trace store `src` as written at `version`: each shard's table `change`d, its
    metadata and marker rewritten, the manifest's version set (its fingerprint covers the
    config and models only)."""
    dst.mkdir(parents=True)
    manifest = json.loads((src / MANIFEST).read_text())
    (dst / MANIFEST).write_text(json.dumps({**manifest, "schema_version": version}))
    for done in sorted(src.glob("shard-*.done")):
        data = done.with_suffix(".parquet")
        table = change(pq.read_table(data))
        meta = {**(table.schema.metadata or {}), b"specrank.version": str(version).encode()}
        out = dst / data.name
        pq.write_table(table.replace_schema_metadata(meta), out)
        marker = {"rows": table.num_rows, "sha256": sha256_file(out)}
        (dst / done.name).write_text(json.dumps(marker))
    return dst


def as_v3(src: Path, dst: Path) -> Path:
    return rewrite_store(src, dst, 3, lambda t: t.drop_columns(["draft_confidence"]))


def test_a_v3_store_reads_as_v4_with_the_column_null(tmp_path):
    traces, _ = small_stores(tmp_path / "s", prompts=4, rounds=3, per_shard=2)
    v3 = as_v3(traces, tmp_path / "v3")
    assert pq.read_schema(next(v3.glob("shard-*.parquet"))).names == [
        n for n in TRACE_SCHEMA.names if n != "draft_confidence"]  # fmt: skip
    now, old = trace_store(traces).read(), trace_store(v3).read()
    assert old.schema.remove_metadata() == TRACE_SCHEMA.remove_metadata()
    assert old.column("draft_confidence").null_count == old.num_rows
    assert old.drop_columns(["draft_confidence"]).equals(now.drop_columns(["draft_confidence"]))
    # read, never written into: recording into it is refused, naming the manifest
    with pytest.raises(SchemaError, match=rf"{MANIFEST}: expected table 'trace' schema version "
                       rf"{SCHEMA_VERSION}, found table 'trace' schema version 3; a v3 store "
                       r"reads as v4 but is not written into"):  # fmt: skip
        trace_store(v3).open_for_writing(json.loads((v3 / MANIFEST).read_text())["config"],
                                         json.loads((v3 / MANIFEST).read_text())["models"])  # fmt: skip
    # no store mixes versions: a v4 shard in a v3 store, a v3 shard in a v4 store
    mixed = tmp_path / "mixed"
    shutil.copytree(v3, mixed)
    first = sorted(traces.glob("shard-*.parquet"))[0].name
    for suffix in (".parquet", ".done"):
        shutil.copy(
            traces / first.replace(".parquet", suffix), mixed / first.replace(".parquet", suffix)
        )
    with pytest.raises(SchemaError, match=rf"{first}: expected trace schema version 3, found 4"):
        trace_store(mixed).read()
    mixed4 = tmp_path / "mixed4"
    shutil.copytree(traces, mixed4)
    for suffix in (".parquet", ".done"):
        shutil.copy(
            v3 / first.replace(".parquet", suffix), mixed4 / first.replace(".parquet", suffix)
        )
    with pytest.raises(SchemaError, match=rf"{first}: trace v{SCHEMA_VERSION}: missing column"):
        trace_store(mixed4).read()
    # a v3 shard lacking another column is still refused
    short = rewrite_store(traces, tmp_path / "short", 3,
                          lambda t: t.drop_columns(["draft_confidence", "covered"]))  # fmt: skip
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['covered'\]"):
        trace_store(short).read()
    # other versions: refused, naming the file, the expected and the found version
    for version in (2, 5):
        other = rewrite_store(traces, tmp_path / f"v{version}", version)
        with pytest.raises(SchemaError, match=rf"v{version}/{MANIFEST}: expected table 'trace' "
                           rf"schema version {SCHEMA_VERSION}, found table 'trace' schema "
                           rf"version {version}$"):  # fmt: skip
            trace_store(other).read()


# -- the report -----------------------------------------------------------------------------------


def test_law_sets_take_the_confidence_on_the_top_set_when_every_round_has_one():
    frame = _frame(np.random.default_rng(2))
    assert all(DSPARK not in ls.preds for ls in law_sets(frame, [], crossfit=False))
    frame["draft_confidence"] = np.random.default_rng(3).random(len(frame))
    sets = law_sets(frame, [], crossfit=False)
    assert [DSPARK in ls.preds for ls in sets] == [ls.candidates == "top" for ls in sets]
    top = next(ls for ls in sets if ls.candidates == "top")
    assert np.array_equal(top.preds[DSPARK], frame["draft_confidence"].to_numpy()[top.rows])
    frame.loc[frame.index[0], "draft_confidence"] = np.nan  # one round without: none
    assert all(DSPARK not in ls.preds for ls in law_sets(frame, [], crossfit=False))


def _train(traces: Path, out: Path):
    features = out / "features"
    extract(traces, features, log=lambda _: None)
    cfg = RerankConfig(traces=str(traces), features=str(features), feature_sets=["rows"],
                       booster=BoosterConfig(kind="lgbm", n_threads=1), budgets=[8],
                       n_resamples=100, calibration_edges=5_000, chunk_rounds=16,
                       fits=None)  # fmt: skip
    uri = MlflowConfig(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    return train_and_evaluate(cfg, uri, {}, 0, out / "run"), cfg


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A synthetic v4 store, its v3 copy and a v4 copy whose rounds hold a confidence."""
    root = tmp_path_factory.mktemp("confstores")
    traces, _ = small_stores(root / "s", prompts=8, rounds=8, per_shard=4)

    def with_confidence(t: pa.Table) -> pa.Table:
        rng = np.random.default_rng(t.num_rows)
        at = t.schema.get_field_index("draft_confidence")
        return t.set_column(at, TRACE_SCHEMA.field("draft_confidence"),
                            pa.array(rng.random(t.num_rows), pa.float32()))  # fmt: skip

    return {"v3": as_v3(traces, root / "v3"),
            "conf": rewrite_store(traces, root / "conf", SCHEMA_VERSION, with_confidence),
            "root": root}  # fmt: skip


def test_a_v3_store_extracts_and_trains_and_the_report_says_why(stores):
    res, _ = _train(stores["v3"], stores["root"] / "train_v3")
    table = res.acceptance.table
    assert DSPARK not in set(table["estimator"]) and not table.empty
    assert DSPARK_NOTE in res.acceptance.text
    assert "not evaluated: this store's drafter records no confidence" in DSPARK_NOTE
    dump = read_dump(stores["root"] / "train_v3" / "run" / "acceptance_dump.parquet")
    assert dump.column(f"{DSPARK}_top").null_count == dump.num_rows


def test_the_report_evaluates_the_recorded_confidence_on_the_top_set(stores, tmp_path):
    res, cfg = _train(stores["conf"], stores["root"] / "train_conf")
    table = res.acceptance.table
    mine = table[table["estimator"] == DSPARK]
    assert set(mine["candidates"]) == {"top"} and set(mine["law"]) == {"greedy", "sampling"}
    assert set(mine["metric"]) == {"auroc", "brier", "ece", "log_loss"}
    assert mine["advantage"].notna().all() and (mine["reference"] == "rows_lgbm").all()
    assert "dspark_confidence: DSpark's calibrated confidence" in res.acceptance.text
    assert DSPARK_NOTE not in res.acceptance.text
    # the figures are the traces' values: the top candidates' draft_confidence as recorded
    run = stores["root"] / "train_conf" / "run"
    d = read_dump(run / "acceptance_dump.parquet").to_pandas()
    assert d.loc[d["is_top"], f"{DSPARK}_top"].notna().all()
    assert d.loc[~d["is_top"], f"{DSPARK}_top"].isna().all()
    rounds = trace_store(stores["conf"]).read(
        columns=["prompt_id", "temperature", "round_index", "draft_confidence"]).to_pandas()  # fmt: skip
    top = d[d["is_top"]].merge(rounds, on=["prompt_id", "temperature", "round_index"])
    assert len(top) == int(d["is_top"].sum())
    assert np.allclose(top[f"{DSPARK}_top"], top["draft_confidence"].astype(np.float64))
    # the bench recomputes its figures from the dump alone, to the bit
    bench, text, _ = bench_report(run, cfg.n_resamples, seed=0)
    keys = ["law", "candidates", "estimator", "metric", "label"]
    both = table.merge(bench, on=keys, suffixes=("", "_b"), validate="one_to_one")
    assert len(both) == len(table) == len(bench)
    for col in ("value", "advantage", "advantage_lo", "advantage_hi"):
        assert np.allclose(both[col], both[f"{col}_b"], rtol=1e-12, equal_nan=True), col
    assert "dspark_confidence: DSpark's calibrated confidence" in text
    # a v1 dump (before the column) reads as v2 with it null
    dump = read_dump(run / "acceptance_dump.parquet")
    v1 = dump.drop_columns([f"{DSPARK}_top"])
    v1 = v1.replace_schema_metadata({**v1.schema.metadata, b"specrank.version": b"1"})
    pq.write_table(v1, tmp_path / "v1.parquet")
    back = read_dump(tmp_path / "v1.parquet")
    assert back.schema.remove_metadata() == DUMP_SCHEMA.remove_metadata()
    assert back.column(f"{DSPARK}_top").null_count == back.num_rows
    assert back.drop_columns([f"{DSPARK}_top"]).equals(dump.drop_columns([f"{DSPARK}_top"]))
    assert math.isfinite(float(mine["value"].iloc[0]))
