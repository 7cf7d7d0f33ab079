"""Trace schema v1 and its shard store: round trip, refusals with clear messages, atomicity."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import synth_chunk
from specrank.store.shard_store import ShardStore
from specrank.store.tables import SchemaError, TableSpec, sha256_file
from specrank.store.trace_schema import SCHEMA_VERSION, TRACE_SCHEMA, TRACE_SPEC, trace_store
from tree.config import PoolConfig, SelectConfig

# A tiny pool (3 + 6 + 6 candidates) keeps these tests about the store, not the generator.
TINY = dict(
    job=SynthJobConfig(toy_prompts=2, rounds_per_prompt=3, prompts_per_shard=2, temperatures=[1.0]),
    pool=PoolConfig(top_k=3, expand_steps=2, expand=2),
    select=SelectConfig(budget=4, record_top_m=6),
    synth=SynthConfig(vocab=8),
    seed=0,
)


@pytest.fixture
def table() -> pa.Table:
    return synth_chunk(0, **TINY)


@pytest.fixture
def store(tmp_path) -> ShardStore:
    s = trace_store(tmp_path / "traces")
    s.open_for_writing({"run": "a"}, models={"target": "toy"})
    return s


def test_round_trip(store, table):
    assert store.write_shard("a", table)
    assert not store.write_shard("a", table)  # done: skipped, nothing rewritten
    back = store.read()
    assert back.schema.equals(TRACE_SCHEMA)
    assert back.equals(table)
    assert back.schema.metadata[b"specrank.version"] == str(SCHEMA_VERSION).encode()
    assert store.dataset().count_rows() == table.num_rows


def test_writer_refuses_missing_and_extra_columns(store, table):
    with pytest.raises(
        SchemaError, match=rf"trace v{SCHEMA_VERSION}: missing column\(s\) \['covered'\]"
    ):
        store.write_shard("a", table.drop_columns(["covered"]))
    with pytest.raises(SchemaError, match=r"extra column\(s\) \['surprise'\]"):
        store.write_shard("a", table.append_column("surprise", pa.array([0] * table.num_rows)))
    assert store.done_shards() == []


def _plant_shard(store: ShardStore, shard_id: str, table: pa.Table) -> None:
    """A shard written behind the writer's back (an old or foreign producer)."""
    path = store.root / f"shard-{shard_id}.parquet"
    pq.write_table(table, path)
    (store.root / f"shard-{shard_id}.done").write_text(
        json.dumps({"rows": table.num_rows, "sha256": sha256_file(path)})
    )


def test_reader_refuses_missing_column(store, table):
    _plant_shard(store, "old", TRACE_SPEC.conform(table).drop_columns(["root_entropy"]))
    with pytest.raises(SchemaError, match=r"missing column\(s\) \['root_entropy'\]"):
        store.read()


def test_reader_refuses_extra_column(store, table):
    t = TRACE_SPEC.conform(table)
    _plant_shard(store, "new", t.append_column("cand_logit", pa.array([0.0] * t.num_rows)))
    with pytest.raises(SchemaError, match=r"extra column\(s\) \['cand_logit'\]"):
        store.read()


def test_reader_refuses_wrong_version(store, table, tmp_path):
    # a shard declaring another schema version
    v2 = TableSpec(name="trace", version=SCHEMA_VERSION + 1, schema=TRACE_SCHEMA)
    _plant_shard(store, "v2", v2.conform(table))
    with pytest.raises(
        SchemaError,
        match=rf"expected trace schema version {SCHEMA_VERSION}, found {SCHEMA_VERSION + 1}",
    ):
        store.read()
    # a store whose manifest declares another version
    other = ShardStore(tmp_path / "v2store", v2)
    other.open_for_writing({"run": "a"})
    with pytest.raises(
        SchemaError,
        match=rf"expected table 'trace' schema version {SCHEMA_VERSION}, found table 'trace' schema version {SCHEMA_VERSION + 1}",
    ):
        trace_store(tmp_path / "v2store").read()


def test_interrupted_write_leaves_no_half_shard(store, table, monkeypatch):
    def dying_write(tab, where, **kwargs):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a shard")  # partial bytes on disk, then the process "dies"
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pq, "write_table", dying_write)
    with pytest.raises(OSError, match="simulated"):
        store.write_shard("a", table)
    monkeypatch.undo()
    leftovers = sorted(p.name for p in store.root.iterdir())
    assert leftovers == ["manifest.json"]  # no shard, no marker, no temp file
    assert not store.is_done("a")
    assert store.read().num_rows == 0
    assert store.write_shard("a", table)  # the rerun writes it
    assert store.read().equals(table)


def test_rerun_with_different_config_is_refused(store, tmp_path):
    again = trace_store(tmp_path / "traces")
    again.open_for_writing({"run": "a"}, models={"target": "toy"})  # same config: accepted
    with pytest.raises(
        SchemaError, match=r"different config or models \(differing keys: \['run'\]\)"
    ):
        again.open_for_writing({"run": "b"}, models={"target": "toy"})
    with pytest.raises(SchemaError, match=r"differing keys: \['models.target'\]"):
        again.open_for_writing({"run": "a"}, models={"target": "other"})
