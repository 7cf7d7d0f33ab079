"""`python -m bench.bench_drafters`: every drafter kind on the same prompts, in one run.

The pocket target with its standalone drafter, its EAGLE-3 head, its block drafters (DFlash's
recipe and DCore's) and its semi-AR drafters (DSpark, Domino; conf/model/pocket*.yaml), each
as a tree and a chain, at the temperature pairs T_t|T_d 0|0, 1|0 and 1|1 and the paper's
budgets B = 8 and 16 (verified tokens, root included; shapes in `bench.drafters`). Online
decoding with the draft rule (`run.score=tree`), every prompt
decoded by every variant and target-only in an order rotating with the prompt (one run per
target temperature; 1|0 and 1|1 share their baseline). Prints, per pair and budget:

- each kind's shape triple (steps/top-k/tokens), tau, tokens/s and the speed-up over
  target-only with a paired prompt-bootstrap interval; a chain drafted at T_d > 0 once per
  `--chain-verifiers` (default: the exhaustive verifier, which accepts a node with p(c), and
  `coupling`, the paper's 1|1 chain acceptance, min(1, p/q));
- the paper's stage split in ms per round (which of our stages merge: `bench.drafters`);
- the low/high-entropy halves (tasks split by the target's entropy on the baseline decodes);
- the budget elasticity B = 8 -> 16: 100 x d ln tau, d ln TPS, d ln eta, paired intervals;
- each kind's tau against `--versus`'s (default: the DFlash-recipe block drafter) at the same
  shape, pair and budget: ratio and difference, paired prompt-bootstrap intervals;
- then, on traces recorded with each kind (disjoint prompts of the same suite, tree pool,
  B = 59, `run.score=record`, both laws at T_d = 0), the offline gain of the cross-fitted
  rerankers over draft at B = 8 and 16 (`rerank.train`'s job, in-process).

On this machine's CPU every drafter is slower than target-only (the pocket target is as
small as its drafters): the CPU figures say so in their header. `bench/gpu_check.sh` runs
the online half on CUDA.

    python -m bench.bench_drafters                                 # 12 prompts, 48 tokens, 24 recorded per kind
    python -m bench.bench_drafters --prompts 4 --max-new-tokens 32 --offline-prompts 0
    python -m bench.bench_drafters --kinds dspark domino block --prompts 0 --offline-prompts 24  # offline half only
    python -m bench.bench_drafters --kinds eagle3 block --pairs '1|0' '1|1' --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import pandas as pd
import torch
import transformers
from omegaconf import OmegaConf

from bench.common import suite_prompts, warmup_count
from bench.drafters import (
    KINDS,
    PAIRS,
    PAPER_STAGES,
    Variant,
    decode_law,
    tau_versus,
    variant_tables,
    variants,
)
from bench.drafters_offline import offline_gains, offline_text
from pairs.block.drafter import BlockDrafter
from pairs.config import ModelConfig
from pairs.models import ModelPair, load_model_pair
from specrank.settings.paths import PROJECT_ROOT, project_path
from specrank.statistics.bootstrap import ci_text

CACHE = PROJECT_ROOT / "bench" / ".cache" / "drafters"


def machine_load() -> str:
    """The machine load (`uptime`), printed beside every figure."""
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def load_kind(kind: str, device: str, dtype: str) -> ModelPair:
    """The pocket pair of a drafter kind (conf/model/<KINDS[kind]>.yaml) on `device`."""
    cfg = OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(PROJECT_ROOT / "conf" / "model" /
                                                          f"{KINDS[kind]}.yaml")))  # fmt: skip
    cfg = dataclasses.replace(cfg, target=str(project_path(cfg.target)),
                              drafter=str(project_path(cfg.drafter)), device=device, dtype=dtype)  # fmt: skip
    return load_model_pair(cfg)


def max_depth(pair: ModelPair) -> int | None:
    """The deepest pool a drafter drafts: a block drafter's block_size - 1, a semi-AR
    drafter's rows (`SemiARSpec.depth`), else unbounded."""
    semi = getattr(pair.drafter, "semi", None)
    if semi is not None:
        return semi.depth
    if isinstance(pair.drafter, BlockDrafter):
        return pair.drafter.spec.block_size - 1
    return None


def _speedup(r: pd.Series) -> str:
    return f"{r['speedup']:.2f}x [{r['speedup_lo']:.2f}, {r['speedup_hi']:.2f}]"


def groups_text(groups: pd.DataFrame, device: str) -> str:
    lines = []
    head = "CPU: every drafter is slower than target-only here" if device == "cpu" else device
    for (pair, b), part in groups[groups["group"] == "all"].groupby(["pair", "budget"], sort=False):
        target = part["target_tokens_per_s"].iloc[0]
        lines.append(f"\n== {pair} (T_t|T_d), B={b} ({head}); target-only {target:.1f} tok/s")
        lines.append(f"  {'drafter':<26} {'shape':>8} {'tau':>6} {'tok/s':>7} "
                     f"{'speed-up [95% CI]':>22}   ms/round: "
                     + " | ".join(PAPER_STAGES))  # fmt: skip
        for _, r in part.iterrows():
            sp = _speedup(r)
            ms = " | ".join(f"{r[f'ms/{s}']:.2f}" for s in PAPER_STAGES)
            lines.append(f"  {r['kind'] + '/' + r['shape']:<26} {r['triple']:>8} {r['tau']:6.3f} "
                         f"{r['tokens_per_s']:7.1f} {sp:>22}   {ms}")  # fmt: skip
    return "\n".join(lines)


def halves_text(groups: pd.DataFrame, halves: pd.DataFrame) -> str:
    lines = ["\n== entropy halves (tasks by the target's mean entropy on the baseline decodes)"]
    for t_t, split in halves.groupby("T_t"):
        named = "; ".join(f"{h}: {' '.join(split.loc[split['half'] == h, 'task'])}"
                          for h in ("low", "high"))  # fmt: skip
        lines.append(f"  T_t={t_t:g}: {named}")
    keyed = groups.set_index(["kind", "shape", "pair", "budget", "group"])
    for (kind, shape, pair, b), _ in groups.groupby(
        ["kind", "shape", "pair", "budget"], sort=False
    ):
        cells = []
        for h in ("low", "high"):
            if (kind, shape, pair, b, f"entropy/{h}") not in keyed.index:
                continue
            r = keyed.loc[(kind, shape, pair, b, f"entropy/{h}")]
            cells.append(f"{h}: tau {r['tau']:.3f}, speed-up {_speedup(r)}")
        lines.append(f"  {pair} B={b:<3} {kind + '/' + shape:<26} " + "; ".join(cells))
    return "\n".join(lines)


def elasticity_text(table: pd.DataFrame) -> str:
    lines = ["\n== budget elasticity (100 x d ln, paired prompt bootstrap): "
             "d ln TPS = d ln tau + d ln eta"]  # fmt: skip
    if table.empty:  # one budget per arm (e.g. --budgets 8): there is no change to show
        lines.append("  none: each drafter ran at one budget (--budgets names two or more)")
    for _, r in table.iterrows():
        cells = [
            f"{q} {ci_text(r[f'd_ln_{q}'], r[f'd_ln_{q}_lo'], r[f'd_ln_{q}_hi'], unit='')}"
            for q in ("tau", "tps", "eta")
        ]
        lines.append(f"  {r['pair']} B={r['from_budget']:g}->{r['to_budget']:g} "
                     f"{r['kind'] + '/' + r['shape']:<26} " + ", ".join(cells))  # fmt: skip
    return "\n".join(lines)


def versus_text(table: pd.DataFrame, base: str) -> str:
    lines = [f"\n== tau against {base} (same shape, pair, budget and prompts; paired prompt "
             "bootstrap, 95%)"]  # fmt: skip
    if table.empty:
        lines.append(f"  none: {base} did not run beside another kind (--kinds, --versus)")
    for _, r in table.iterrows():
        ratio = f"{r['tau_ratio']:.3f}x [{r['tau_ratio_lo']:.3f}, {r['tau_ratio_hi']:.3f}]"
        diff = f"{r['tau_diff']:+.3f} [{r['tau_diff_lo']:+.3f}, {r['tau_diff_hi']:+.3f}]"
        lines.append(f"  {r['pair']} B={r['budget']:<3} {r['kind'] + '/' + r['shape']:<26} "
                     f"tau {r['tau']:.3f} vs {r['base_tau']:.3f}: ratio {ratio}, "
                     f"difference {diff}")  # fmt: skip
    return "\n".join(lines)


def run_online(pairs: dict[str, ModelPair], prompts, chosen: list[Variant], args) -> dict:
    """Both target temperatures' runs; their tables, keyed by table name."""
    frames: dict[str, list[pd.DataFrame]] = {"groups": [], "elasticity": [], "halves": [],
                                             "versus": []}  # fmt: skip
    warmup = warmup_count(args.warmup_prompts, args.device, len(prompts))
    for t_t in sorted({v.temperatures[0] for v in chosen}):
        law = [v for v in chosen if v.temperatures[0] == t_t]
        t0 = time.perf_counter()
        # exact greedy equality is asserted in float32 only (decode_law)
        timings = decode_law(pairs, prompts, law, args.max_new_tokens, warmup,
                             exact=args.dtype == "float32")  # fmt: skip
        if t_t == 0:
            runs = [p.greedy_match for t in timings.values() for p in t]
            print(f"T_t=0: {sum(runs)} of {len(runs)} decodes equal target-only's output "
                  f"({args.dtype})")  # fmt: skip
        eos = next(iter(pairs.values())).eos_ids
        groups, elasticity, halves = variant_tables(timings, eos, args.resamples)
        print(f"T_t={t_t:g}: {len(law)} decoders x {len(prompts)} prompts in "
              f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
        versus = tau_versus(timings, args.versus, args.resamples)
        tables = (groups, elasticity, halves.assign(T_t=t_t), versus)
        for name, frame in zip(frames, tables, strict=True):
            frames[name].append(frame)
    return {k: pd.concat(v, ignore_index=True) for k, v in frames.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--shapes", nargs="+", default=["tree", "chain"], choices=["tree", "chain"])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    ap.add_argument("--chain-verifiers", nargs="+", default=["exhaustive", "coupling"],
                    choices=["exhaustive", "eagle3", "coupling"],
                    help="verifiers of a chain drafted at T_d > 0, each its own decoder")  # fmt: skip
    ap.add_argument("--budgets", nargs="+", type=int, default=[8, 16],
                    help="the paper's B: verified tokens, root included")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=12,
                    help="the default suite's first N, in turn (0: skip the online half)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--offline-prompts", type=int, default=24,
                    help="prompts recorded per kind for the offline gains (0: skip that half)")  # fmt: skip
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--versus", default="block", choices=list(KINDS),
                    help="the kind every other kind's tau is compared with, paired")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="untimed decodes per decoder and target-only (default 1; CUDA: all)")  # fmt: skip
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None, help="write every table as JSON here")
    args = ap.parse_args(argv)
    if args.prompts < 0 or args.offline_prompts < 0:
        ap.error("--prompts, --offline-prompts: expected >= 0")
    if args.prompts == 0 and args.offline_prompts == 0:
        ap.error("--prompts 0 --offline-prompts 0: neither half would run")
    if min(args.budgets) < 3:
        ap.error(f"--budgets: a chain of B - 1 drafted nodes needs B >= 3; got {args.budgets}")
    return args


def online_half(pairs: dict[str, ModelPair], prompts, args, load_before: str,
                ) -> tuple[dict, list[str]]:  # fmt: skip
    """The online half, printed; its tables as records, and the variants not run."""
    depth = {k: d for k, p in pairs.items() if (d := max_depth(p)) is not None}
    chosen, skipped = variants(args.kinds, args.shapes, args.pairs, args.budgets, depth,
                               tuple(args.chain_verifiers))  # fmt: skip
    print(f"{len(prompts)} prompts (data=default), <= {args.max_new_tokens} new tokens, "
          f"rule=draft, score=tree, {args.dtype} on {args.device}, {args.threads} thread(s); "
          f"{load_before}")  # fmt: skip
    print("shapes (steps/top-k/tokens; select.budget = B - 1 drafted nodes): " + ", ".join(
        sorted({f"{v.label} B={v.budget} {v.triple()}" for v in chosen})))  # fmt: skip
    for note in skipped:
        print(f"  not run: {note}")
    tables = run_online(pairs, prompts, chosen, args)
    print(groups_text(tables["groups"], args.device))
    print(halves_text(tables["groups"], tables["halves"]))
    print(elasticity_text(tables["elasticity"]))
    print(versus_text(tables["versus"], args.versus))
    return {k: v.to_dict("records") for k, v in tables.items()}, skipped


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    load_before = machine_load()
    prompts, fit = suite_prompts(args.prompts, args.offline_prompts)
    pairs = {k: load_kind(k, args.device, args.dtype) for k in args.kinds}
    out, skipped = online_half(pairs, prompts, args, load_before) if prompts else ({}, [])
    if not prompts:
        print(f"online half not run (--prompts 0); {args.threads} thread(s); {load_before}")
    if args.offline_prompts > 0:
        t0 = time.perf_counter()
        gains = offline_gains(pairs, fit, args.max_new_tokens, [b - 1 for b in args.budgets],
                              CACHE, args.resamples)  # fmt: skip
        print(offline_text(gains))
        print(f"offline half: {len(fit)} prompts a kind, <= {args.max_new_tokens} new tokens, "
              f"{time.perf_counter() - t0:.0f} s (recordings cached in {CACHE})")  # fmt: skip
        out["offline"] = gains.to_dict("records")
    load_after = machine_load()
    print(f"\n{load_after}")
    out |= {"load_before": load_before, "load_after": load_after, "skipped": skipped,
            "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main()
