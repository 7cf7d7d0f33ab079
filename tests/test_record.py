"""`python -m decode.record`: config composition, trace content, resume, prompt sources."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose
from omegaconf import OmegaConf

import decode.record as record
import decode.recording as recording
import specrank.settings.config  # noqa: F401  (registers the schema)
from pairs.config import DataConfig, PromptSource
from pairs.prompts import encode_prompt, load_prompts, load_source
from specrank.settings.errors import Refusal
from specrank.settings.paths import project_path
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import TRACE_SCHEMA, trace_store
from tests.tiny_models import one_thread, tiny_model_config, tiny_pair

SPEC_BENCH = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
)
TEXTS = ["Hello there", "def f(x):", "Count: 1, 2, 3,", "Why is the sky blue?", "abc abc abc"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model_config(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _prompt_file(tmp_path: Path, n: int = len(TEXTS)) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "task": "t", "prompt": t}) + "\n"
            for i, t in enumerate(TEXTS[:n])
        )
    )
    return path


def _compose(models, prompts: Path, out: Path, *extra: str):
    return compose(
        "record",
        overrides=[
            f"model.name={models.name}",
            f"model.target={models.target}",
            f"model.drafter={models.drafter}",
            "data=spec_bench",
            "data.name=mini",
            f"data.sources=[{{kind:jsonl,path:'{prompts}'}}]",
            f"trace.out_dir={out}",
            "trace.prompts_per_shard=2",
            "trace.progress=false",
            *extra,
        ],
    )


SMALL = [
    "pool.top_k=4",
    "pool.expand_steps=3",
    "pool.expand=3",
    "select.budget=8",
    "select.record_top_m=12",
    "decode.max_new_tokens=10",
]


def _run(cfg) -> None:
    with one_thread():
        record.main(cfg)


def _table(out: Path, drop_times: bool = True):
    t = trace_store(out).read()
    if drop_times:
        t = t.drop_columns([c for c in t.column_names if c.startswith("time_")])
    return t.sort_by([("prompt_id", "ascending"), ("round_index", "ascending")])


def test_record_yaml_defaults(hydra_conf):
    cfg = compose("record")
    assert cfg.model.name == "pocket" and cfg.data.name == "default"
    assert cfg.trace.out_dir == "data_out/traces"  # both temperatures share one store
    assert cfg.decode.max_new_tokens == 256 and cfg.select.budget == 59 and cfg.pool.top_k == 10


def test_trace_rows_honour_the_contract(hydra_conf, models, tmp_path):
    """Default 710-candidate pool, B=59, greedy: counts, scored parents, exact edge probabilities."""
    out = tmp_path / "traces"
    _run(_compose(models, _prompt_file(tmp_path, 2), out, "decode.max_new_tokens=6"))
    store = trace_store(out)
    assert store.done_shards() == ["t0.0-b59-00000"]
    manifest = store.manifest()
    assert (
        manifest["config"]["select"]["budget"] == 59
        and manifest["models"]["target"] == models.target
    )
    t = store.read()
    assert t.schema.names == TRACE_SCHEMA.names
    rows = t.to_pylist()
    pair = tiny_pair(Path(models.target).parent, "qwen3")
    by_prompt: dict[str, list[dict]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r)
    checked = 0
    for pid, rounds in by_prompt.items():
        rounds.sort(key=lambda r: r["round_index"])
        tokens = encode_prompt(pair.tokenizer, TEXTS[int(pid[1:])])
        assert rounds[0]["prompt_length"] == len(tokens) and rounds[0]["tokens_before"] == 0
        for r in rounds:
            parent = np.array(r["cand_parent"])
            depth = np.array(r["cand_depth"])
            scored = np.array(r["cand_scored"])
            in_tree = np.array(r["cand_in_tree"])
            assert (
                len(parent) == 710
                and [int((depth == d).sum()) for d in range(1, 9)] == [10] + [100] * 7
            )
            assert int(np.sum(r["cand_expanded"])) == 70 and int(in_tree.sum()) == 59
            assert bool(scored[parent[parent >= 0]].all())  # every candidate's parent is scored
            assert (
                not (in_tree & ~scored).any()
                and (np.array(r["cand_target_argmax"]) >= 0).tolist() == scored.tolist()
            )
            assert (
                r["root_token"] == tokens[-1]
                and r["tokens_before"] == len(tokens) - rounds[0]["prompt_length"]
            )
            path = r["accepted_path"]
            assert all(in_tree[i] for i in path) and [depth[i] for i in path] == list(
                range(1, len(path) + 1)
            )
            # Greedy: each accepted token is the argmax at its parent; the continuation too.
            argmax = [r["root_argmax"]] + [r["cand_target_argmax"][i] for i in path]
            assert [r["cand_token"][i] for i in path] + [r["continuation_token"]] == argmax
            # Target edge probabilities equal direct computation (unit-temperature softmax at T=0).
            rng = np.random.default_rng(r["round_index"])
            for i in [*range(3), *rng.choice(710, size=6, replace=False).tolist()]:
                prefix, j = [], int(parent[i])
                while j >= 0:
                    prefix.insert(0, r["cand_token"][j])
                    j = int(parent[j])
                with torch.inference_mode():
                    row = (
                        pair.target(input_ids=torch.tensor([tokens + prefix]))
                        .logits[0, -1]
                        .float()
                        .softmax(-1)
                    )
                assert abs(float(row[r["cand_token"][i]]) - r["cand_target_prob"][i]) < 1e-5
                checked += 1
            assert r["time_draft_ms"] > 0 and r["time_verify_ms"] > 0
            tokens = tokens + [r["cand_token"][i] for i in path] + [r["continuation_token"]]
    assert checked >= 18


def test_resume_after_an_interrupted_run_gives_identical_shards(
    hydra_conf, models, tmp_path, monkeypatch
):
    prompts = _prompt_file(tmp_path)
    sampled = [*SMALL, "decode.temperature=1.0"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _run(_compose(models, prompts, full, *sampled))

    real, calls = recording.decode_prompt, []

    def killed_on_the_third_prompt(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as if the run were killed mid-shard
        return real(*args, **kw)

    monkeypatch.setattr(recording, "decode_prompt", killed_on_the_third_prompt)
    with pytest.raises(KeyboardInterrupt):
        _run(_compose(models, prompts, resumed, *sampled))
    store = trace_store(resumed)
    assert store.done_shards() == ["t1.0-b8-00000"]  # shard 1 never half-written
    marker = (resumed / "shard-t1.0-b8-00000.done").read_text()
    monkeypatch.setattr(recording, "decode_prompt", real)
    _run(_compose(models, prompts, resumed, *sampled))
    assert (resumed / "shard-t1.0-b8-00000.done").read_text() == marker  # finished shard not redone
    assert (
        store.done_shards()
        == trace_store(full).done_shards()
        == [f"t1.0-b8-0000{k}" for k in range(3)]
    )
    assert _table(resumed).equals(_table(full))


def test_a_different_config_into_the_same_folder_is_refused(hydra_conf, models, tmp_path):
    prompts, out = _prompt_file(tmp_path, 1), tmp_path / "t"
    _run(_compose(models, prompts, out, *SMALL))
    with pytest.raises(SchemaError, match=r"differing keys: \['select.budget'\]"):
        _run(_compose(models, prompts, out, *SMALL, "select.budget=4"))


def test_missing_model_path_fails_before_decoding(hydra_conf, models, tmp_path):
    cfg = _compose(
        models, _prompt_file(tmp_path, 1), tmp_path / "t", "model.drafter=/nowhere/drafter"
    )
    with pytest.raises(
        FileNotFoundError, match=r"model.drafter: no such folder '/nowhere/drafter'"
    ):
        _run(cfg)


# -- prompt sources ------------------------------------------------------------------------


def test_spec_bench_first_turns_with_categories():
    prompts = load_source(PromptSource(kind="spec_bench", path=str(SPEC_BENCH)))
    assert len(prompts) == 480 and prompts[0].id == "81" and prompts[0].task == "writing"
    first = json.loads(SPEC_BENCH.read_text().splitlines()[0])
    assert prompts[0].text == first["turns"][0]
    assert {p.task for p in prompts} >= {
        "translation",
        "summarization",
        "qa",
        "math_reasoning",
        "rag",
    }


def test_humaneval_from_the_bundled_file():
    prompts = load_source(PromptSource(kind="humaneval", task="coding"))
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0" and prompts[0].task == "coding"
    assert prompts[0].text.startswith("from typing import List")


def test_paper_protocol_has_644_unique_prompts(hydra_conf):
    data = OmegaConf.to_object(compose("record", overrides=["data=paper"]).data)
    sources = [
        PromptSource(s.kind, None if s.path is None else str(project_path(s.path)), s.task, s.limit)
        for s in data.sources
    ]
    prompts = load_prompts(DataConfig(name=data.name, sources=sources))
    assert len(prompts) == 644 and len({p.id for p in prompts}) == 644


def test_jsonl_source_and_its_errors(tmp_path):
    path = _prompt_file(tmp_path)
    assert [p.id for p in load_source(PromptSource(kind="jsonl", path=str(path), limit=2))] == [
        "q0",
        "q1",
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no 'task' field"):
        load_source(PromptSource(kind="jsonl", path=str(bad)))
    with pytest.raises(ValueError, match=r"duplicate prompt ids \['q0', 'q1'"):
        load_prompts(DataConfig(name="d", sources=[PromptSource("jsonl", str(path))] * 2))
    with pytest.raises(
        ValueError, match=r"'kind' must be one of \['spec_bench', 'humaneval', 'jsonl'\]. Got 'csv'"
    ):
        load_source(PromptSource(kind="csv", path=str(path)))
    with pytest.raises(Refusal, match="no such file"):
        load_source(PromptSource(kind="jsonl", path=str(tmp_path / "none.jsonl")))


def test_chat_template_when_present_plain_text_otherwise(tmp_path):
    qwen = tiny_pair(tmp_path / "q", "qwen3").tokenizer
    ids = encode_prompt(qwen, "hi")
    text = qwen.decode(ids)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>") and text.endswith(
        "<think>\n\n</think>\n\n"
    )
    llama = tiny_pair(tmp_path / "l", "llama").tokenizer
    assert llama.chat_template is None and encode_prompt(llama, "hi") == llama("hi")["input_ids"]


def test_both_temperatures_fill_one_store(hydra_conf, tmp_path, models):
    """`-m decode.temperature=0,1` writes both laws into one trace store, keyed by shard."""
    prompts, out = _prompt_file(tmp_path, 2), tmp_path / "traces"
    for t in ("0", "1"):
        _run(_compose(models, prompts, out, *SMALL, f"decode.temperature={t}"))
    table = trace_store(out).read(columns=["temperature", "prompt_id", "round_index"])
    assert sorted(set(table["temperature"].to_pylist())) == [0.0, 1.0]
    assert sorted(trace_store(out).done_shards()) == ["t0.0-b8-00000", "t1.0-b8-00000"]
    # a different budget into the same store is still refused
    with pytest.raises(Exception, match=r"select\.budget"):
        _run(_compose(models, prompts, out, *SMALL, "select.budget=4"))
