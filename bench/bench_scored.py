"""`python -m bench.bench_scored`: verify time against the prefixes a pass scores.

    python -m bench.bench_scored                       # pocket pair if present (else tiny); CPU
    python -m bench.bench_scored --quick               # 2 prompts x 24 tokens: a smoke run
    python -m bench.bench_scored --device cuda --dtype bfloat16 --out bench_out/scored.json

Every prompt is decoded with rule=draft at one budget under each scored-set policy
(`run.score`: tree, top_m at each --top-m, frontier, record, pool), the policies in
an order rotating with the prompt's position, after one untimed warm-up, all in this
process: the extra prefixes ride in the tree pass, so the output is the same under
every policy and only the verify stage should grow. Printed per policy: mean scored
prefixes per pass (beside the root), verify ms per round (median and mean), the whole
round's median, and the verify median as a ratio to `tree`'s in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pandas as pd
import torch

from bench.bench_online import settings
from bench.common import load_pair, suite_prompts, warmup_count
from decode.loop import decode_prompt
from decode.metrics import PromptTiming, round_table
from decode.session import arm_order
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.models import ModelPair
from pairs.prompts import Prompt, encode_prompt


def policies(top_ms: list[int]) -> list[tuple[str, str, int]]:
    """(label, run.score, run.score_top_m) of every policy the bench times; `tree` first."""
    top = [(f"top_m{m}", "top_m", m) for m in top_ms]
    return [("tree", "tree", 100), *top, *((p, p, 100) for p in ("frontier", "record", "pool"))]


def bench_scored(pair: ModelPair, prompts: list[Prompt], base: DecodeSettings,
                 top_ms: list[int], warmup: int = 1) -> pd.DataFrame:  # fmt: skip
    """One row per policy: scored prefixes, verify and round ms, ratio to tree (this run),
    after untimed decodes of the first `warmup` prompts by every policy."""
    arms = policies(top_ms)
    by_arm = {label: OnlineSettings(base, "draft", score, False, m) for label, score, m in arms}
    encoded = [encode_prompt(pair.tokenizer, p.text) for p in prompts]

    def one(i: int, label: str):
        p = prompts[i]
        return decode_prompt(pair.target, pair.drafter, encoded[i], by_arm[label], pair.eos_ids,
                             p.id, p.task)  # fmt: skip

    with torch.inference_mode():
        for i in range(warmup):
            for label, _, _ in arms:
                one(i, label)
        runs: dict[str, list[PromptTiming]] = {a[0]: [] for a in arms}
        for i in range(len(prompts)):
            for label, _, _ in arm_order(arms, i):
                runs[label].append(
                    PromptTiming(prompts[i].id, prompts[i].task, one(i, label), 0, 0.0)
                )
    rows = []
    for label, score, m in arms:
        r = round_table(runs[label])
        stage_cols = [c for c in r if c.startswith("ms_")]
        rows.append({
            "policy": label, "score": score, "top_m": m if score == "top_m" else None,
            "rounds": len(r), "tau": r["tau"].mean(), "scored_prefixes": r["scored"].mean(),
            "verify_ms_median": r["ms_verify"].median(), "verify_ms_mean": r["ms_verify"].mean(),
            "round_ms_median": r[stage_cols].sum(axis=1).median(),
        })  # fmt: skip
    table = pd.DataFrame(rows)
    table["verify_over_tree"] = table["verify_ms_median"] / table["verify_ms_median"].iloc[0]
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=("auto", "pocket", "tiny"), default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-m", type=int, nargs="+", default=[16, 32, 100])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="untimed decodes per policy (default 1; CUDA: all)")  # fmt: skip
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.max_new_tokens = 2, 24
    torch.set_num_threads(a.threads)
    pair, name = load_pair(a.model, a.device, a.dtype)
    prompts, _ = suite_prompts(a.prompts, 0)
    base = settings("draft", a.temperature, a.budget, a.max_new_tokens).base
    table = bench_scored(pair, prompts, base, a.top_m,
                         warmup_count(a.warmup_prompts, a.device, len(prompts)))  # fmt: skip
    load = os.getloadavg()[0]
    print(f"scored prefixes vs verify time: {name} pair on {a.device} ({a.dtype}), rule=draft, "
          f"B={a.budget}, T={a.temperature:g}, {len(prompts)} prompts x {a.max_new_tokens} "
          f"tokens, {a.threads} thread(s), load {load:.2f}")  # fmt: skip
    print(table.to_string(index=False, float_format="%.3f"))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"pair": name, "device": a.device, "load": load,
                                     "rows": table.to_dict("records")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
