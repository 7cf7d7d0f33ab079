"""The head recipe's data: training-side conversations and the target's own replies, rendered
under the target's chat template, cut into windows and captured once through the target.

What enters: ShareGPT conversations on the training side of the pocket corpus' split rule
(`recipes.pocket.corpus.is_heldout`), minus any whose turn matches a prompt of the project's
prompt files (`data/prompts/`); and the target's greedy replies to the first user turns of
other training-side conversations. Loss positions are the assistant tokens.

What is captured per window (one `shard_NNNNN.safetensors` per target forward, written
atomically, so an interrupted capture resumes at the first missing shard):
- `ids` [b, L] and `aux` [b, L, k * H] (the target's states entering the aux layers);
- `top_v`, `top_i` [b, L, top_k]: the target's log-probabilities renormalised over the draft
  vocabulary, its `top_k` largest, as draft ids (the loss' soft labels);
- `rows` [b, L]: position p trains (token p + 1 is an assistant token and the target's argmax
  at p lies in the draft vocabulary, as EAGLE-3's loss mask).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from pairs.eagle3.capture import join_aux
from pairs.prompts import encode_prompt
from recipes.eagle3.config import HeadCorpusConfig
from recipes.pocket import corpus
from recipes.pocket.config import CorpusConfig
from specrank.settings.paths import project_path

Doc = tuple[list[int], list[bool]]  # token ids, loss mask (assistant tokens)


def excluded_keys() -> set[str]:
    """Text keys of every prompt in the project's prompt files: never trained on."""
    keys: set[str] = set()
    for path in sorted(project_path("data/prompts").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                keys.add(corpus.text_key(json.loads(line)["prompt"]))
    return keys


def training_conversations(cc: CorpusConfig, seed: int) -> list[list[tuple[str, str]]]:
    """Training-side conversations (user/assistant turns), in a seeded order."""
    excluded = excluded_keys()
    out = []
    for conv in corpus.iter_sharegpt():
        turns = corpus.turns_of(conv)[: cc.max_turns]
        if not turns or corpus.is_heldout(str(conv.get("id", "")), cc):
            continue
        if any(corpus.text_key(t) in excluded for _, t in turns):
            continue
        if corpus.ascii_share("".join(t for _, t in turns)) < cc.min_ascii_share:
            continue
        out.append(turns)
    random.Random(seed).shuffle(out)
    return out


def render(tok, turns: list[tuple[str, str]]) -> Doc:
    """Ids under the chat template, masked on assistant turns: each turn's text is the
    difference of the template rendered with and without it (any template, no markers)."""
    ids: list[int] = []
    mask: list[bool] = []
    done = ""
    messages: list[dict] = []
    for role, text in turns:
        messages.append({"role": role, "content": text})
        full = tok.apply_chat_template(messages, tokenize=False)
        piece = full[len(done) :] if full.startswith(done) else full
        if not full.startswith(done):  # a template that rewrites earlier turns: restart
            ids, mask = [], []
        new = tok(piece, add_special_tokens=False)["input_ids"]
        ids += new
        mask += [role == "assistant"] * len(new)
        done = full
    return ids, mask


def conversation_docs(tok, convs: list[list[tuple[str, str]]], n_tokens: int) -> list[Doc]:
    """Rendered conversations with an assistant turn, up to `n_tokens` tokens in all."""
    docs, total = [], 0
    for turns in convs:
        if total >= n_tokens:
            break
        if turns[0][0] != "user" or not any(r == "assistant" for r, _ in turns):
            continue
        doc = render(tok, turns)
        docs.append(doc)
        total += len(doc[0])
    return docs


def reply_prompts(tok, convs, cfg: HeadCorpusConfig) -> list[list[int]]:
    """First user turns of conversations not rendered whole, encoded as the decoder does."""
    out = []
    for turns in convs:
        if len(out) >= cfg.reply_prompts:
            break
        if turns[0][0] == "user":
            ids = encode_prompt(tok, turns[0][1])
            if len(ids) <= cfg.max_prompt_tokens:
                out.append(ids)
    return out


@torch.no_grad()
def replies(target, tok, prompts: list[list[int]], cfg: HeadCorpusConfig, log) -> list[Doc]:
    """The target's greedy replies (transformers' `generate`, left padding), masked on the
    reply; generation stops at the target's end-of-turn tokens."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = target.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
    docs: list[Doc] = []
    for lo in range(0, len(prompts), cfg.reply_batch):
        chunk = prompts[lo : lo + cfg.reply_batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = target.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=cfg.reply_tokens,
            do_sample=False, pad_token_id=pad, eos_token_id=sorted(stops),
        )  # fmt: skip
        for p, g in zip(chunk, out[:, width:].tolist(), strict=True):
            n = next((i + 1 for i, t in enumerate(g) if t in stops), len(g))
            docs.append((p + g[:n], [False] * len(p) + [True] * n))
        log(f"replies: {len(docs)}/{len(prompts)}")
    return docs


def windows(docs: list[Doc], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Docs concatenated and cut into [n, length] windows (ids int32, mask bool); the tail
    shorter than a window is dropped."""
    ids = np.fromiter((t for d in docs for t in d[0]), dtype=np.int32)
    mask = np.fromiter((m for d in docs for m in d[1]), dtype=bool)
    n = len(ids) // length
    return ids[: n * length].reshape(n, length), mask[: n * length].reshape(n, length)


def frequent_tokens(ids: np.ndarray, mask: np.ndarray, n: int) -> np.ndarray:
    """The `n` most frequent trained-on tokens, ascending ids (EAGLE-3's d2t rule)."""
    counts = np.bincount(ids[mask].astype(np.int64))
    order = np.argsort(-counts, kind="stable")[:n]  # ties: lower id first
    return np.sort(order)


@torch.no_grad()
def capture_batch(target, ids: np.ndarray, mask: np.ndarray, aux, draft, top_k: int) -> dict:
    """One target forward over windows [b, L]: the arrays of one shard (module docstring)."""
    x = torch.from_numpy(ids.astype(np.int64))
    out = target(input_ids=x, output_hidden_states=True)
    feats = join_aux([out.hidden_states[i] for i in aux])
    logits = out.logits.float()
    in_draft = torch.zeros(logits.shape[-1], dtype=torch.bool)
    in_draft[draft] = True
    restricted = logits[..., draft].log_softmax(-1)
    top_v, top_i = restricted.topk(top_k, dim=-1)
    rows = in_draft[logits.argmax(-1)]
    rows[:, :-1] &= torch.from_numpy(mask[:, 1:])
    rows[:, -1] = False  # the last row's next token is outside the window
    return {
        "ids": ids.astype(np.int32),
        "aux": feats.to(torch.float16).numpy(),
        "top_v": top_v.to(torch.float16).numpy(),
        "top_i": top_i.to(torch.int16).numpy(),
        "rows": rows.numpy().astype(np.uint8),
    }


def capture(target, ids, mask, aux, draft, cfg: HeadCorpusConfig, work: Path, log) -> list[Path]:
    """Every shard of windows (ids, mask) in `work`; existing shards are kept (resume)."""
    work.mkdir(parents=True, exist_ok=True)
    paths = []
    draft_t = torch.from_numpy(draft.astype(np.int64))
    for s, lo in enumerate(range(0, len(ids), cfg.capture_batch)):
        path = work / f"shard_{s:05d}.safetensors"
        paths.append(path)
        if path.is_file():
            continue
        hi = lo + cfg.capture_batch
        t0 = time.time()
        arrays = capture_batch(target, ids[lo:hi], mask[lo:hi], aux, draft_t, cfg.target_top_k)
        tmp = path.with_suffix(".tmp")
        save_file(arrays, str(tmp), metadata={"seconds": f"{time.time() - t0:.3f}"})
        tmp.replace(path)
        if s % 10 == 0:
            log(f"capture: shard {s + 1} of {-(-len(ids) // cfg.capture_batch)}")
    return paths


def capture_minutes(work: Path) -> float:
    """The capture's own time, from the seconds each shard records (over interrupted runs)."""
    from safetensors import safe_open

    total = 0.0
    for path in work.rglob("shard_*.safetensors"):
        with safe_open(str(path), "np") as f:
            total += float((f.metadata() or {}).get("seconds", 0.0))
    return total / 60


def load_shards(paths: list[Path]) -> dict[str, np.ndarray]:
    """The captured arrays, windows concatenated along the first axis."""
    parts = [load_file(str(p)) for p in paths]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
