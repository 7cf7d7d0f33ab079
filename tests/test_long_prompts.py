"""Long prompts (issue 30): every prompt checked before the first decode, an EAGLE-3 head's
configured length a warning, and `decode.run` keeping what it finished when it fails."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pandas as pd
import pytest

import decode.record as record
import decode.session as session
from decode.baseline import autoregressive_decode
from decode.config import RunConfig, TraceConfig
from decode.loop import decode_prompt
from decode.run import run_online
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig, PromptSource
from pairs.models import load_model_pair
from specrank.store.trace_schema import trace_store
from tests.eagle3_heads import eagle3_config, tiny_target, write_head
from tests.tiny_models import one_thread, tiny_model_config
from tree.config import DecodeConfig, PoolConfig, SelectConfig

POOL = PoolConfig(top_k=3, expand_steps=2, expand=3)
SETTINGS = DecodeSettings(pool=POOL, select=SelectConfig(budget=4, record_top_m=4),
                          decode=DecodeConfig(max_new_tokens=6))  # fmt: skip
LONG = "a" * 4100  # the tiny models' char tokenizer: > max_position_embeddings=4096


def _data(tmp_path: Path, prompts: dict[str, str], **kw) -> DataConfig:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": k, "task": "t", "prompt": v}) + "\n"
                            for k, v in prompts.items()))  # fmt: skip
    return DataConfig(name="t", sources=[PromptSource(kind="jsonl", path=str(path))], **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> ModelConfig:
    return tiny_model_config(tmp_path_factory.mktemp("long") / "m", "llama")


def test_a_long_prompt_is_refused_before_any_model_loads(tmp_path, models, monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the prompts were checked")

    monkeypatch.setattr(record, "load_model_pair", refuse)
    data = _data(tmp_path, {"short": "hello", "long": LONG, "longer": LONG + "b"})
    msg = (r"data: 2 of 3 prompts are too long for model.target \(max_position_embeddings=4096;"
           r".*decode.max_new_tokens=6 \+ depth 3\): long \(410\d tokens\), longer \(410\d tokens\)"
           r".*data.long_prompts=skip")  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        record.run_record(models, data, SETTINGS, TraceConfig(out_dir=str(tmp_path / "t")), {})


def test_long_prompts_skipped_on_request_and_counted(tmp_path, models, caplog):
    data = _data(tmp_path, {"short": "hello", "long": LONG}, long_prompts="skip")
    trace = TraceConfig(out_dir=str(tmp_path / "t"), progress=False)
    with one_thread(), caplog.at_level(logging.WARNING, logger="pairs.positions"):
        rep = record.run_record(models, data, SETTINGS, trace, {"what": "test"})
    assert rep.prompts_decoded == 1
    assert set(
        trace_store(tmp_path / "t").read(columns=["prompt_id"])["prompt_id"].to_pylist()
    ) == {"short"}
    assert "1 of 2 prompts skipped, too long for model.target" in caplog.text


def test_long_prompts_setting_stays_out_of_the_manifest():
    from decode.config import manifest_view

    view = manifest_view({"data": {"name": "x", "long_prompts": "skip"},
                          "model": {"strict_head_positions": True, "name": "m"}})  # fmt: skip
    assert view == {"data": {"name": "x"}, "model": {"name": "m"}}


def test_decode_run_keeps_the_finished_prompts_when_it_fails(tmp_path, models, monkeypatch):
    real = session.decode_prompt

    def fails_on_c(*args, **kw):
        if args[5] == "c":  # prompt_id
            raise RuntimeError("injected failure on prompt c")
        return real(*args, **kw)

    monkeypatch.setattr(session, "decode_prompt", fails_on_c)
    run = RunConfig(score="record", record_traces=True, traces_out=str(tmp_path / "traces"),
                    warmup_prompts=0, bootstrap_resamples=20, progress=False)  # fmt: skip
    s = OnlineSettings(SETTINGS, "draft", "record", record=True)
    data = _data(tmp_path, {"a": "hi there", "b": "def f(x):", "c": "why", "d": "ok"})
    with one_thread(), pytest.raises(RuntimeError, match="injected failure on prompt c"):
        run_online(models, data, s, run, None, {"run": dataclasses.asdict(run)}, tmp_path / "out",
                   prompts_per_shard=1)  # fmt: skip
    kept = pd.read_parquet(tmp_path / "out" / "partial_rounds.parquet")
    assert set(kept["prompt_id"]) == {"a", "b"}
    store = trace_store(tmp_path / "traces")
    assert len(store.done_shards()) == 2
    assert set(store.read(columns=["prompt_id"])["prompt_id"].to_pylist()) == {"a", "b"}
    # the rerun decodes everything and keeps the two finished shards (same config)
    monkeypatch.setattr(session, "decode_prompt", real)
    with one_thread():
        run_online(models, data, s, run, None, {"run": dataclasses.asdict(run)}, tmp_path / "o2",
                   prompts_per_shard=1)  # fmt: skip
    assert len(store.done_shards()) == 4 and store.read().num_rows == len(
        store.read(columns=["prompt_id", "round_index"]).to_pandas().drop_duplicates()
    )


# -- an EAGLE-3 head's configured length: a warning, up to the target's limit ----------------------


@pytest.fixture(scope="module")
def short_head(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny target (4096 positions) and a head whose config says 40 (its 'training length')."""
    root = tmp_path_factory.mktemp("head")
    target = tiny_target(root, "llama")
    head = write_head(root / "head", target, seed=5)
    cfg = json.loads((head / "config.json").read_text())
    cfg["max_position_embeddings"] = 40
    (head / "config.json").write_text(json.dumps(cfg))
    return target, head


def test_an_eagle3_head_decodes_past_its_configured_length(short_head, caplog):
    pair = load_model_pair(eagle3_config(*short_head))
    prompt = pair.tokenizer("the quick brown fox jumps over")["input_ids"]
    s = DecodeSettings(pool=POOL, select=SelectConfig(budget=4),
                       decode=DecodeConfig(max_new_tokens=24))  # fmt: skip
    assert len(prompt) + 24 + 3 > 40
    with one_thread(), caplog.at_level(logging.WARNING, logger="decode.stream"):
        out = decode_prompt(pair.target, pair.drafter, prompt, OnlineSettings(s, "draft"),
                            frozenset())  # fmt: skip
        plain = autoregressive_decode(pair.target, prompt, len(out.output), frozenset(), 0.0)
    assert out.output == plain[: len(out.output)]  # greedy equality past the head's length
    assert "pass the EAGLE-3 head's configured max_position_embeddings=40" in caplog.text


def test_strict_head_positions_refuses_past_the_heads_length(short_head):
    pair = load_model_pair(eagle3_config(*short_head, strict_head_positions=True))
    prompt = pair.tokenizer("the quick brown fox jumps over")["input_ids"]
    s = DecodeSettings(pool=POOL, select=SelectConfig(budget=4),
                       decode=DecodeConfig(max_new_tokens=24))  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"model.drafter: a \d+-token prompt .* needs \d+ "
        r"positions, but the model has max_position_embeddings=40",
    ):
        decode_prompt(pair.target, pair.drafter, prompt, OnlineSettings(s, "draft"), frozenset())
