"""`python -m bench.bench_eagle3`: the pocket EAGLE-3 head against the standalone pocket drafter.

A view of `bench.bench_drafters` (the same decoding loop): same target weights, same
prompts (the default suite, `data=default`), same run: every prompt is decoded with each
drafter and target-only, in an order rotating with the prompt's position, after one
untimed warm-up prompt. Online decoding with the draft rule (`run.score=tree`), default
710-candidate pool, B = 59 drafted nodes. Prints per law and drafter: tau (accepted + 1
per round), tokens/s, the speed-up over target-only and the ratio eagle3 / standalone, the
per-round stage means (draft, verify, the rest), and the machine load before and after.

    python -m bench.bench_eagle3                          # T=0 and T=1, 64 new tokens
    python -m bench.bench_eagle3 --laws 0 --max-new-tokens 32 --prompts 6
    python -m bench.bench_eagle3 --card                   # also record the figures in the card
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from bench.bench_drafters import load_kind, machine_load
from bench.common import suite_prompts
from bench.drafters import Variant, decode_law, variant_tables
from recipes.pocket.eagle3_card import write_card
from specrank.settings.paths import PROJECT_ROOT

NAMES = ("standalone", "eagle3")


def card_rows(groups, law: str) -> list[dict]:
    """The card's rows of one law: each drafter's tau, speed and stage split, target-only's speed."""
    rows = []
    for _, g in groups[groups["group"] == "all"].iterrows():
        rows.append({"law": law, "drafter": g["kind"], "tau": g["tau"],
                     "tokens_per_s": g["tokens_per_s"], "speedup": g["speedup"],
                     "draft_ms": g["ms/setup+rollout+resync"],
                     "verify_ms": g["ms/target fwd+acceptance"],
                     "other_ms": g["ms/proposal assembly"] + g["ms/cache compaction"]})  # fmt: skip
    target = groups["target_tokens_per_s"].iloc[0]
    return [*rows, {"law": law, "drafter": "target-only", "tau": 1.0, "tokens_per_s": target}]


def print_law(rows: list[dict], law: str, seconds: float) -> None:
    print(f"\n{law} ({seconds:.0f} s)")
    print(f"  {'drafter':<12} {'tau':>6} {'tok/s':>8} {'vs target':>9}   per-round ms: "
          f"{'draft':>7} {'verify':>7} {'rest':>7}")  # fmt: skip
    for r in rows:
        if r["drafter"] == "target-only":
            print(f"  {r['drafter']:<12} {1:6.3f} {r['tokens_per_s']:8.1f} {1:9.2f}x")
            continue
        print(f"  {r['drafter']:<12} {r['tau']:6.3f} {r['tokens_per_s']:8.1f} "
              f"{r['speedup']:9.2f}x   {r['draft_ms']:20.2f} {r['verify_ms']:7.2f} "
              f"{r['other_ms']:7.2f}")  # fmt: skip
    e, sa = (next(r for r in rows if r["drafter"] == n) for n in ("eagle3", "standalone"))
    print(f"  eagle3 / standalone: tau x{e['tau'] / sa['tau']:.3f}, "
          f"tokens/s x{e['tokens_per_s'] / sa['tokens_per_s']:.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--laws", type=float, nargs="+", default=[0.0, 1.0], help="temperatures")
    ap.add_argument("--prompts", type=int, default=12, help="the first N / 2 of each suite source")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=59, help="drafted nodes (select.budget)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--card", action="store_true", help="write the figures into the head's card")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    load_before = machine_load()
    prompts, _ = suite_prompts(args.prompts, 0)
    pairs = {n: load_kind(n, "cpu", "float32") for n in NAMES}
    print(f"{len(prompts)} prompts (data=default), <= {args.max_new_tokens} new tokens, pool 710, "
          f"B={args.budget}, rule=draft, score=tree, float32, {args.threads} thread(s); "
          f"{load_before}")  # fmt: skip
    rows = []
    for temp in args.laws:
        t0 = time.perf_counter()
        # T_d = 0: the drafts of today's null setting, labelled (the paper's 0|0 and 1|0)
        law = [Variant(n, "tree", f"{temp:g}|0", args.budget + 1) for n in NAMES]
        timings = decode_law(pairs, prompts, law, args.max_new_tokens)
        groups, _, _ = variant_tables(timings, pairs["eagle3"].eos_ids, 200)
        law_rows = card_rows(groups, f"T={temp:g}")
        print_law(law_rows, f"T={temp:g}", time.perf_counter() - t0)
        rows += law_rows
    load_after = machine_load()
    print(f"\n{load_after}")
    if args.card:
        folder = PROJECT_ROOT / "models" / "pocket" / "eagle3"
        facts = json.loads((folder / "recipe.json").read_text())
        facts["suite"] = {
            "command": "python -m bench.bench_eagle3 --card",
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "pool": "710 (the default pool, docs/method.md#pool)",
            "budget": args.budget,
            "threads": args.threads,
            "load": f"{load_before} before, {load_after} after",
            "rows": rows,
        }
        write_card(folder, facts)
        print(f"figures written to {folder / 'MODEL_CARD.md'}")


if __name__ == "__main__":
    main()
