"""Fault injection: corrupt, truncated or foreign shards and manifests, kills mid-write, bad
settings. Every fault is refused with a message naming the file (or setting) and the remedy,
or is provably harmless (the parsed content is unchanged): never a silently changed value."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import decode.record as record
from decode.config import TraceConfig
from decode.stream import DecodeSettings
from features.extract import extract
from pairs.config import DataConfig, PromptSource
from recipes.synth.config import SynthConfig, SynthJobConfig
from recipes.synth.job import write_synthetic_traces
from rerank.config import RerankConfig
from rerank.train import train_and_evaluate
from specrank.settings.config import MlflowConfig
from specrank.store.shard_store import ShardStore
from specrank.store.tables import SchemaError, sha256_file
from specrank.store.trace_schema import SCHEMA_VERSION, TRACE_SPEC, trace_store
from tests.tiny_models import tiny_model_config
from tree.config import DecodeConfig, SelectConfig

JOB = SynthJobConfig(toy_prompts=4, rounds_per_prompt=3, prompts_per_shard=2)


@pytest.fixture(scope="module")
def clean_store(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "traces"
    write_synthetic_traces(out, JOB, DecodeSettings().pool, SelectConfig(), SynthConfig(), 0)
    return out


@pytest.fixture()
def store(clean_store, tmp_path) -> ShardStore:
    """A fresh copy of the clean store for each test to break."""
    copy = tmp_path / "traces"
    copy.mkdir()
    for f in clean_store.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return trace_store(copy)


def _flip(path: Path, offset: int) -> bytes:
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    return original


def _first_shard(store: ShardStore) -> tuple[str, Path]:
    sid = store.done_shards()[0]
    return sid, store.root / f"shard-{sid}.parquet"


def test_byte_flips_anywhere_in_a_shard_are_refused(store):
    sid, path = _first_shard(store)
    size = path.stat().st_size
    for offset in np.linspace(0, size - 1, 40).astype(int):
        original = _flip(path, int(offset))
        with pytest.raises(SchemaError, match=rf"shard '{sid}'.*corrupt.*rerun the\s+writer"):
            store.dataset()
        path.write_bytes(original)
    assert store.read().num_rows > 0  # restored: readable again


def test_extract_refuses_a_corrupt_trace_shard_by_name(store, tmp_path):
    sid, path = _first_shard(store)
    _flip(path, path.stat().st_size // 2)
    with pytest.raises(SchemaError, match=rf"features.extract.*shard '{sid}'.*rerun the\s+writer"):
        extract(store.root, tmp_path / "features", log=lambda _: None)


def test_a_truncated_shard_is_refused_by_name(store):
    sid, path = _first_shard(store)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SchemaError, match=rf"shard '{sid}' of the trace store .* is corrupt"):
        store.read()


@pytest.mark.parametrize("name", ["manifest.json", "marker"])
def test_byte_flips_in_a_manifest_or_marker_are_refused_or_harmless(store, name):
    sid, _ = _first_shard(store)
    path = store.root / (name if name == "manifest.json" else f"shard-{sid}.done")
    size = path.stat().st_size
    refused = harmless = 0
    for offset in range(0, size, max(1, size // 60)):
        original = _flip(path, offset)
        try:
            rows = store.read().num_rows
        except SchemaError:
            refused += 1
        else:
            # accepted only if nothing changed once parsed (e.g. JSON whitespace)
            assert json.loads(path.read_bytes()) == json.loads(original), offset
            assert rows > 0
            harmless += 1
        path.write_bytes(original)
    assert refused > 0 and refused + harmless > 0


def test_a_shard_of_another_schema_version_is_refused(store):
    table = store.read()
    other = SCHEMA_VERSION + 1
    foreign = table.replace_schema_metadata(
        {b"specrank.table": b"trace", b"specrank.version": str(other).encode()}
    )
    path = store.root / "shard-99999.parquet"
    pq.write_table(foreign, path)
    marker = {"rows": foreign.num_rows, "sha256": sha256_file(path)}
    (store.root / "shard-99999.done").write_text(json.dumps(marker))
    with pytest.raises(
        SchemaError, match=f"expected trace schema version {SCHEMA_VERSION}, found {other}"
    ):
        store.read()


def test_a_kill_mid_write_leaves_no_shard_and_the_rerun_redoes_it(store, monkeypatch):
    sid, path = _first_shard(store)
    want = sha256_file(path)
    path.unlink()
    (store.root / f"shard-{sid}.done").unlink()
    real = pq.write_table

    def killed(table, where, **kw):
        real(table.slice(0, 1), where, **kw)  # half a file on disk, then the kill
        raise KeyboardInterrupt

    monkeypatch.setattr(pq, "write_table", killed)
    with pytest.raises(KeyboardInterrupt):
        write_synthetic_traces(
            store.root, JOB, DecodeSettings().pool, SelectConfig(), SynthConfig(), 0
        )
    assert sid not in store.done_shards() and not path.exists()
    assert not list(store.root.glob(".*tmp*"))  # the temp file is gone too
    monkeypatch.setattr(pq, "write_table", real)
    write_synthetic_traces(store.root, JOB, DecodeSettings().pool, SelectConfig(), SynthConfig(), 0)
    assert sha256_file(path) == want  # the redone shard is the one the clean run wrote


def test_extract_refuses_infinite_or_positive_draft_scores(store, tmp_path):
    sid, path = _first_shard(store)
    table = pq.read_table(path)
    col = table.column("cand_draft_logprob").to_pylist()
    col[0][3] = float("inf")
    table = table.set_column(
        table.schema.get_field_index("cand_draft_logprob"),
        table.schema.field("cand_draft_logprob"),
        pa.array(col, table.schema.field("cand_draft_logprob").type),
    )
    path.unlink()
    (store.root / f"shard-{sid}.done").unlink()
    store.write_shard(sid, TRACE_SPEC.conform(table))
    with pytest.raises(ValueError, match=rf"shard {sid}.*NaN, \+inf or positive"):
        extract(store.root, tmp_path / "features", log=lambda _: None)


def test_extract_refuses_an_empty_trace_store(tmp_path):
    empty = trace_store(tmp_path / "empty")
    empty.open_for_writing({"what": "nothing"})
    with pytest.raises(ValueError, match="holds no finished shards"):
        extract(empty.root, tmp_path / "features", log=lambda _: None)


# -- bad settings: each refused with its setting, the allowed values and the value found, --------
# -- before any model loads or anything is fitted -------------------------------------------------


@pytest.fixture()
def no_model_loads(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(record, "load_model_pair", refuse)


def _prompts(tmp_path: Path, lines: list[dict]) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return DataConfig(name="t", sources=[PromptSource(kind="jsonl", path=str(path))])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            DecodeSettings(select=SelectConfig(budget=1000)),
            r"The 'select.budget' must be an int in the range \[1, 710\]. Got 1000 instead.",
        ),
        (
            DecodeSettings(select=SelectConfig(record_top_m=-5)),
            r"The 'select.record_top_m' must be an int in the range \[0, inf\). Got -5 instead.",
        ),
        (
            DecodeSettings(decode=DecodeConfig(temperature=-1.0)),
            r"The 'decode.temperature' must be a number in the range \[0, inf\). Got -1.0",
        ),
        (
            DecodeSettings(select=SelectConfig(rule="root")),
            r"The 'select.rule' for recording must be one of \['draft'\]. Got 'root' instead.",
        ),
    ],
)
def test_bad_record_settings_fail_before_models_load(tmp_path, no_model_loads, settings, message):
    data = _prompts(tmp_path, [{"id": "a", "task": "t", "prompt": "hi"}])
    model = tiny_model_config(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=message):
        record.run_record(model, data, settings, TraceConfig(out_dir=str(tmp_path / "o")), {})


def test_an_empty_prompt_file_fails_before_models_load(tmp_path, no_model_loads):
    model = tiny_model_config(tmp_path / "m", "llama")
    with pytest.raises(ValueError, match=r"data=t: the prompt sources .* hold no prompts"):
        record.run_record(
            model, _prompts(tmp_path, []), DecodeSettings(), TraceConfig(out_dir="x"), {}
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"budgets": [0]}, r"'rerank.budgets' must be a non-empty list of ints in the range \[1, inf\)\. Got \[0\]"),
        ({"budgets": [-2]}, r"'rerank.budgets' must be a non-empty list of ints in the range \[1, inf\)\. Got \[-2\]"),
        ({"calibrators": ["iso_q1", "platt"]}, r"'rerank.calibrators' must be a list of values from \['iso_q1', 'per_depth', 'rank_control'\].*unknown: \['platt'\]"),
        ({"substitutions": ["cache", "matched"]}, r"'rerank.substitutions' must be a list of values from \['cache', 'same', 'prev'\].*unknown: \['matched'\]"),
        ({"feature_sets": ["rowz"]}, r"'rerank.feature_sets' must be a list of values from \['base', 'rows', 'rows_extra', 'rows_matched'\]"),
        ({"halves": "odd"}, r"'rerank.halves' must be one of \['even_odd', 'seeded'\]. Got 'odd'"),
        ({"mixture_weights": [0.0]}, r"'rerank.mixture_weights' must be a number in the range \(0, 1\]. Got 0.0"),
        ({"n_resamples": 0}, r"'rerank.n_resamples' must be an int in the range \[1, inf\). Got 0"),
        ({"train_share": 0.0}, r"'rerank.train_share' must be a number in the range \(0, 1\]. Got 0.0"),
    ],
)  # fmt: skip
def test_bad_rerank_settings_fail_before_anything_is_read(tmp_path, change, message):
    rerank = RerankConfig(traces=str(tmp_path / "none"), features=str(tmp_path / "none"), **change)
    with pytest.raises(ValueError, match=message):
        train_and_evaluate(rerank, MlflowConfig(), {}, 0, tmp_path / "out")
