"""`features.extract`: candidate schema, store round trip, resume, refusals, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from features import from_trace
from features.extract import _expand_short_overrides, extract
from features.first_level import FEATURE_DTYPES, LABEL_DTYPES
from features.from_trace import TRACE_COLUMNS, candidate_table
from features.registry import FEATURE_SET_TREE, first_in, set_features
from features.schema import (
    CANDIDATE_SCHEMA,
    CANDIDATE_SPEC,
    KEY_COLUMNS,
    LABEL_COLUMNS,
    candidate_store,
)
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from specrank.store.shard_store import ShardStore
from specrank.store.tables import SchemaError, TableSpec
from specrank.store.trace_schema import SCHEMA_VERSION, TRACE_SCHEMA, trace_store
from tests.fake_traces import random_trace
from tests.test_features import OUTCOME_COLUMNS
from tree.config import PoolConfig, SelectConfig

ROOT = Path(__file__).resolve().parents[1]


def _write_traces(root: Path, seeds: list[int], spec: TableSpec | None = None) -> ShardStore:
    store = ShardStore(root, spec) if spec else trace_store(root)
    store.open_for_writing({"what": "test traces"}, {"target": "toy"})
    for i, seed in enumerate(seeds):
        rows = random_trace(seed, n_prompts=2, n_rounds=3).to_pylist()
        for row in rows:
            row["prompt_id"] = f"s{i}-{row['prompt_id']}"  # whole prompts per shard
        store.write_shard(f"{i:03d}", pa.Table.from_pylist(rows, schema=TRACE_SCHEMA))
    return store


def test_schema_columns_are_keys_features_labels() -> None:
    names = CANDIDATE_SCHEMA.names
    features = [n for n in names if n not in KEY_COLUMNS + LABEL_COLUMNS]
    assert features == [n for n in FEATURE_DTYPES if n != "round_index"]  # round_index is a key
    assert LABEL_COLUMNS == list(LABEL_DTYPES) == names[-2:]
    base = set_features("base")
    rows = [n for s in FEATURE_SET_TREE if s.parent is not None for n in first_in(s.name)]
    assert set(base) | set(rows) == set(features) | {"task", "round_index"}
    assert not set(base) & set(rows) and len(set(rows)) == len(rows)
    assert "token_prior" not in names  # fold-dependent: computed by the reranker (SPEC §7)


def test_every_trace_column_is_input_or_outcome() -> None:
    """A new trace column must be classified here (and in the no-look-ahead test) before use."""
    # outcomes the adapter reads: labels, and the *previous* round's accepted length
    read_outcomes = {"cand_target_prob", "root_argmax", "accepted_path"}
    inputs = set(TRACE_COLUMNS) - read_outcomes
    assert inputs.isdisjoint(OUTCOME_COLUMNS)
    assert read_outcomes <= set(OUTCOME_COLUMNS)
    # identity the extractor does not read: breakdowns take the category from the traces
    # ... and the drafter's own confidence (known before verification), which the acceptance
    # report reads from the traces
    not_read = {"category", "draft_confidence"}
    assert set(TRACE_SCHEMA.names) == inputs | set(OUTCOME_COLUMNS) | not_read


def test_store_round_trip(tmp_path: Path) -> None:
    table = candidate_table(random_trace(3, n_prompts=3, n_rounds=4))
    store = candidate_store(tmp_path / "cand")
    store.open_for_writing({"k": 1})
    store.write_shard("000", table)
    back = store.read()
    assert back.schema.equals(CANDIDATE_SPEC.schema, check_metadata=True)
    assert back.to_pylist() == CANDIDATE_SPEC.conform(table).to_pylist()
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['label_is_argmax'\]"):
        CANDIDATE_SPEC.conform(table.drop_columns(["label_is_argmax"]))


def test_extract_writes_one_shard_per_trace_shard_and_resumes(tmp_path: Path) -> None:
    traces = _write_traces(tmp_path / "traces", [1, 2, 3])
    out = tmp_path / "cand"
    lines: list[str] = []
    report = extract(traces.root, out, log=lines.append)
    assert (report.shards_written, report.shards_skipped) == (3, 0)
    assert "rows/s" in lines[0]
    store = candidate_store(out)
    assert store.done_shards() == traces.done_shards()
    n1 = sum(
        sum(d == 1 for d in ds) for ds in traces.read(["cand_depth"])["cand_depth"].to_pylist()
    )
    assert store.read().num_rows == report.candidates == n1
    manifest = store.manifest()
    assert manifest["config"]["source_fingerprint"] == traces.fingerprint()
    assert manifest["models"] == {"target": "toy"}

    # rerun: nothing to do; lose one output shard: only it is redone, identically
    first = store.read().to_pylist()
    assert extract(traces.root, out, log=lines.append).shards_written == 0
    (out / "shard-001.done").unlink()
    (out / "shard-001.parquet").unlink()
    again = extract(traces.root, out, log=lines.append)
    assert (again.shards_written, again.shards_skipped) == (1, 2)
    assert store.read().to_pylist() == first


def test_extract_refuses_changed_traces(tmp_path: Path) -> None:
    traces = _write_traces(tmp_path / "traces", [1])
    extract(traces.root, tmp_path / "cand", log=lambda _: None)
    traces.write_shard("999", random_trace(9, n_prompts=1, n_rounds=2))
    with pytest.raises(SchemaError, match=r"differing keys: \['source_fingerprint'\]"):
        extract(traces.root, tmp_path / "cand", log=lambda _: None)


def test_wrong_trace_schema_version_is_refused(tmp_path: Path) -> None:
    old = TableSpec(name="trace", version=99, schema=TRACE_SCHEMA)
    traces = _write_traces(tmp_path / "traces", [1], spec=old)
    with pytest.raises(
        SchemaError,
        match=rf"expected table 'trace' schema version {SCHEMA_VERSION}, found table 'trace' schema version 99",
    ):
        extract(traces.root, tmp_path / "cand", log=lambda _: None)
    assert not (tmp_path / "cand").exists()


def test_empty_shard_gives_empty_table() -> None:
    table = candidate_table(random_trace(0).slice(0, 0))
    assert table.num_rows == 0 and table.schema.equals(CANDIDATE_SCHEMA)


def test_prompt_split_across_shards_is_refused(tmp_path: Path) -> None:
    rows = random_trace(4, n_prompts=1, n_rounds=3).to_pylist()
    shard = pa.Table.from_pylist([r for r in rows if r["round_index"] != 1], schema=TRACE_SCHEMA)
    with pytest.raises(SchemaError, match=r"has round 2 but not round 1 in the same shard"):
        candidate_table(shard)
    store = trace_store(tmp_path / "traces")
    store.open_for_writing({"what": "split prompt"})
    store.write_shard("007", shard)
    with pytest.raises(SchemaError, match=r"^features.extract: trace shard 007 of .*round 1"):
        extract(store.root, tmp_path / "cand", log=lambda _: None)


def test_padded_pools_leave_each_round_unchanged() -> None:
    """A round's features do not depend on the pools it is batched with (padding path)."""
    uniform = random_trace(5, n_prompts=2, n_rounds=3, level_sizes=[4, 6, 3])
    other = random_trace(6, n_prompts=1, n_rounds=3, level_sizes=[2, 9])
    other = other.set_column(
        0, TRACE_SCHEMA.field("prompt_id"), pa.array(["other"] * other.num_rows)
    )
    mixed = pa.concat_tables([uniform, other])
    a = candidate_table(uniform)
    b = candidate_table(mixed).slice(0, a.num_rows)
    assert a.to_pylist() == b.to_pylist()


def test_short_overrides() -> None:
    argv = ["traces=/a", "out=b", "paths.traces=/c", "debug=default", "features.out=x=y"]
    assert _expand_short_overrides(argv) == [
        "features.traces=/a",
        "features.out=b",
        "paths.traces=/c",
        "debug=default",
        "features.out=x=y",
    ]


def test_config_composes_with_paths_defaults() -> None:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="extract", overrides=["paths.traces=/t"])
        assert cfg.features.traces == "/t"
        assert cfg.features.out == "data_out/features"
        cfg = compose(
            config_name="extract", overrides=_expand_short_overrides(["traces=/a", "out=/b"])
        )
        assert (cfg.features.traces, cfg.features.out) == ("/a", "/b")


def test_cli_short_form(tmp_path: Path) -> None:
    traces = _write_traces(tmp_path / "traces", [1, 2])
    out = tmp_path / "cand"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "features.extract",
            f"traces={traces.root}",
            f"out={out}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "rows/s" in done.stdout
    assert candidate_store(out).done_shards() == ["000", "001"]
    assert json.loads((out / "manifest.json").read_text())["table"] == "candidates"
    assert np.isfinite(candidate_store(out).read(["draft_prob"])["draft_prob"].to_numpy()).all()


def test_synthetic_traces_end_to_end(tmp_path: Path) -> None:
    """Extraction of the synthetic generator's traces, checked against pool invariants."""
    job = SynthJobConfig(toy_prompts=4, rounds_per_prompt=6, prompts_per_shard=2)
    traces = tmp_path / "traces"
    write_synthetic_traces(traces, job, PoolConfig(), SelectConfig(), SynthConfig(), seed=1)
    report = extract(traces, tmp_path / "cand", log=lambda _: None)
    assert (report.rounds, report.candidates) == (24, 240)
    df = candidate_store(tmp_path / "cand").read().to_pandas()
    rounds = df.groupby(["prompt_id", "round_index"])
    assert (rounds["subtree_size"].sum() == 700).all()  # 710 candidates, 10 at depth 1
    assert (rounds["expanded"].sum() == 10).all()  # every first-level node is expanded
    assert (rounds["draft_rank"].apply(sorted).apply(list) == [list(range(10))] * 24).all()
    assert (rounds["label_is_argmax"].sum() <= 1).all()
    # prev_accepted = tokens emitted by the previous round minus its continuation
    df = df[df.cand_index == 0].sort_values(["prompt_id", "round_index"])
    emitted = df.groupby("prompt_id")["tokens_before"].diff()
    assert df["prev_accepted"].isna().equals(df["round_index"] == 0)
    np.testing.assert_array_equal(df["prev_accepted"].dropna(), (emitted - 1).dropna())


def test_chunked_extraction_equals_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards are processed in chunks of rounds; the chunk size never changes a value."""
    trace = random_trace(8, n_prompts=3, n_rounds=5)
    whole = candidate_table(trace)
    monkeypatch.setattr(from_trace, "CHUNK_ROUNDS", 4)
    assert candidate_table(trace).to_pylist() == whole.to_pylist()
