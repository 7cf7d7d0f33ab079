"""Prompts carry the paper's seven tasks (SPEC §9) and keep their finer category."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from hydra import compose
from omegaconf import OmegaConf

from decode.loop import _trace_row
from decode.round import STAGES  # the stages the row assembly reads
from pairs.config import DataConfig, PromptSource
from pairs.positions import check_prompt_lengths
from pairs.prompts import Prompt, load_prompts, load_source
from specrank.settings.paths import project_path
from specrank.statistics.bootstrap import PromptSums
from specrank.store.trace_schema import SCHEMA_VERSION, TRACE_SCHEMA, trace_store
from tests.test_record import _compose, _prompt_file, _run
from tests.tiny_models import tiny_model_config

SEVEN = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "coding"}
# The eight MT-bench categories of Spec-Bench's first 80 records (../shared/data/README.md).
MT_BENCH = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
]


def _data(hydra_conf_name: str) -> DataConfig:
    """A data config group option composed and resolved as `decode.record` resolves it."""
    data = OmegaConf.to_object(compose("record", overrides=[f"data={hydra_conf_name}"]).data)
    sources = [
        dataclasses.replace(s, path=None if s.path is None else str(project_path(s.path)))
        for s in data.sources
    ]
    return dataclasses.replace(data, sources=sources)


def test_paper_data_has_the_seven_tasks(hydra_conf):
    prompts = load_prompts(_data("paper"))
    by_task = Counter(p.task for p in prompts)
    assert by_task == {**dict.fromkeys(SEVEN - {"coding"}, 80), "coding": 164}
    mt = [p for p in prompts if p.task == "mt_bench"]
    assert Counter(p.category for p in mt) == dict.fromkeys(MT_BENCH, 10)
    assert {p.id for p in mt} == {str(i) for i in range(81, 161)}  # question_id 81-160
    coding = [p for p in prompts if p.task == "coding"]
    assert {p.category for p in coding} == {"humaneval"}  # MT-bench's coding is not here
    assert all(p.id.startswith("HumanEval/") for p in coding)
    # the other Spec-Bench categories are their own task
    rest = [p for p in prompts if p.task not in {"mt_bench", "coding"}]
    assert all(p.category == p.task for p in rest)


def test_spec_bench_and_humaneval_configs(hydra_conf):
    spec = load_prompts(_data("spec_bench"))
    assert Counter(p.task for p in spec) == dict.fromkeys(SEVEN - {"coding"}, 80)
    assert spec[0].id == "81" and spec[0].task == "mt_bench" and spec[0].category == "writing"
    he = load_prompts(_data("humaneval"))
    assert len(he) == 164 and Counter(p.task for p in he) == {"coding": 164}


def test_default_suite_maps_sharegpt_labels_onto_the_seven(hydra_conf):
    data = _data("default")
    # every ShareGPT held-out record (not only the default slice of 6) has a task
    whole = [dataclasses.replace(s, limit=None) for s in data.sources]
    prompts = load_prompts(dataclasses.replace(data, sources=whole))
    assert {p.task for p in prompts} <= SEVEN
    sharegpt = [p for p in prompts if p.id.startswith("sharegpt/")]
    assert len(sharegpt) == 200
    assert {p.task for p in sharegpt if p.category in {"chat", "writing"}} == {"mt_bench"}
    default = load_prompts(data)
    # 60 HumanEval + 60 held-out ShareGPT prompts (issue 15: enough to learn from)
    assert len(default) == 120 and {p.task for p in default} <= SEVEN
    assert sum(p.id.startswith("HumanEval/") for p in default) == 60


def _spec_bench_file(tmp_path: Path, categories: list[str]) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text(
        "".join(
            json.dumps({"question_id": 81 + i, "category": c, "turns": [f"q{i}"]}) + "\n"
            for i, c in enumerate(categories)
        )
    )
    return path


def test_an_unmapped_category_is_refused_by_name(tmp_path):
    path = _spec_bench_file(tmp_path, ["writing", "qa", "poetry"])
    source = PromptSource(
        kind="spec_bench", path=str(path), tasks={"writing": "mt_bench", "qa": "qa"}
    )
    with pytest.raises(
        ValueError, match=r"question.jsonl:3 .*must be one of \['qa', 'writing'\]. Got 'poetry'"
    ):
        load_source(source)
    # a jsonl record's own label is its category, refused the same way
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"id": "a", "task": "chat", "prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1 .*\['qa'\]. Got 'chat'"):
        load_source(PromptSource(kind="jsonl", path=str(jsonl), tasks={"qa": "qa"}))


def test_a_bad_tasks_mapping_is_refused(tmp_path):
    path = _spec_bench_file(tmp_path, ["qa"])
    for tasks in ({}, {"qa": ""}, {"qa": None}):  # the last leaves every category out
        with pytest.raises(ValueError, match=r"'tasks' must map each category .* Got"):
            load_source(PromptSource(kind="spec_bench", path=str(path), tasks=tasks))


def test_a_category_mapped_to_null_is_left_out_and_limit_counts_the_kept(tmp_path):
    path = _spec_bench_file(tmp_path, ["writing", "summarization", "qa", "qa"])
    source = PromptSource(kind="spec_bench", path=str(path),
                          tasks={"writing": "mt_bench", "summarization": None, "qa": "qa"})  # fmt: skip
    assert [p.category for p in load_source(source)] == ["writing", "qa", "qa"]
    limited = dataclasses.replace(source, limit=2)
    assert [p.category for p in load_source(limited)] == ["writing", "qa"]


def test_the_heldout_suite_is_never_read_by_the_default_one_and_fits_the_pocket_target(
    hydra_conf,
):
    heldout, default = load_prompts(_data("heldout")), load_prompts(_data("default"))
    assert not {p.id for p in heldout} & {p.id for p in default}
    assert not {p.text for p in heldout} & {p.text for p in default}
    by_task = Counter(p.task for p in heldout)
    assert by_task == dict.fromkeys(["mt_bench", "translation", "qa", "math_reasoning", "rag"], 80)
    # every prompt fits the pocket target's 2,048 positions at the default output limit
    cfg = compose("run", overrides=["data=heldout"])
    model = OmegaConf.to_object(cfg.model)
    model = dataclasses.replace(model, target=str(project_path(model.target)))
    kept = check_prompt_lengths(model, heldout, cfg.decode.max_new_tokens,
                                OmegaConf.to_object(cfg.pool), "refuse")  # fmt: skip
    assert len(kept) == 400


def test_without_a_mapping_the_category_is_the_task(tmp_path):
    path = _spec_bench_file(tmp_path, ["writing", "qa"])
    prompts = load_source(PromptSource(kind="spec_bench", path=str(path)))
    assert [(p.task, p.category) for p in prompts] == [("writing", "writing"), ("qa", "qa")]
    assert Prompt("x", "coding", "t").category == "coding"


def _row(task: str, category: str) -> dict:
    settings = SimpleNamespace(
        rule="draft",
        base=SimpleNamespace(
            decode=SimpleNamespace(temperature=0.0), select=SimpleNamespace(budget=8)
        ),
    )
    record = SimpleNamespace(stage_ms=[0.0] * len(STAGES), fields={})
    ctx = SimpleNamespace(round_index=0, tokens_before=0, prompt_length=3)
    return _trace_row(record, ctx, "p", task, category, settings)


def test_trace_rows_carry_task_and_category():
    row = _row("mt_bench", "roleplay")
    assert (row["task"], row["category"]) == ("mt_bench", "roleplay")
    assert Prompt("81", "mt_bench", "text", "roleplay").category == "roleplay"


def test_trace_schema_has_a_category_column():
    assert SCHEMA_VERSION >= 2  # v2 added it
    field = TRACE_SCHEMA.field("category")
    assert field.type == "string" and not field.nullable
    assert TRACE_SCHEMA.names.index("category") == TRACE_SCHEMA.names.index("task") + 1


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model_config(tmp_path_factory.mktemp("qwen3"), "qwen3")


def test_recorded_traces_carry_the_mapped_task_and_the_category(hydra_conf, models, tmp_path):
    prompts, out = _prompt_file(tmp_path, 2), tmp_path / "t"  # records labelled "t"
    cfg = _compose(models, prompts, out, "decode.max_new_tokens=4", "pool.top_k=4",
                   "pool.expand_steps=2", "pool.expand=2", "select.budget=4", "select.record_top_m=0")  # fmt: skip
    cfg.data.sources[0].tasks = {"t": "qa"}
    _run(cfg)
    t = trace_store(out).read()
    assert set(t.column("task").to_pylist()) == {"qa"}
    assert set(t.column("category").to_pylist()) == {"t"}


def test_task_weighting_reads_the_seven_tasks(hydra_conf):
    """Task-equal bootstrap groups follow the prompts' `task`: seven on the paper's data."""
    rounds = [{"prompt_id": p.id, "task": p.task, "v": 1.0} for p in load_prompts(_data("paper"))]
    sums = PromptSums.from_rounds(pd.DataFrame(rounds), ["v"])
    assert set(sums.tasks) == SEVEN and sums.prompts.size == 644
