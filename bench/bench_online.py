"""`python -m bench.bench_online`: online speed of draft, root-draw and reranker selection.

    python -m bench.bench_online                          # pocket pair if present (else tiny); CPU
    python -m bench.bench_online --quick                  # 4 prompts x 32 tokens: a smoke run
    python -m bench.bench_online --device cuda --dtype bfloat16 --out bench_out/online.json
    python -m bench.bench_online --small-fit 6000        # where a small fit's time goes

For each temperature and budget (default T in {0, 1}, B in {8, 59}): target-only
decoding of every prompt once (the speedup baseline of that temperature), then
every rule on every prompt, all in this process. Per run: tokens/s, speedup
over the baseline with a paired prompt-bootstrap interval, tau (tokens per
round), per-stage ms per round, and the reranker's features + predict time per
round in microseconds and as a share of the round and of drafting.

Rerankers: --reranker-t0 / --reranker-t1 (folders written by save_reranker), or
fitted here as `rerank.train` fits them by default (--kind, --feature-set
rows_matched, --capacity default: early stopping; `paper`: the fixed 400 trees) on
traces recorded from prompts outside the benchmark's (cached under bench/.cache/).
The per-round cost is measured with the paper-capacity model too, in the same run
(--cost-baseline), and printed as a ratio. Also reported:
phat latency of each prediction route for one round's first level (--rows rows),
as ratios to LightGBM's / scikit-learn's own predictor measured in the same run.

Per round: the reranker's features and prediction of one round, split
into its steps (`decode.reranker.PHASES`), on --cost-prompts prompts at the
largest budget: "in decode" = the call the decoder makes (caches as the models'
passes left them: what a round pays), "repeated" = the same call on the same round
--cost-reps more times (warm caches; the minimum). On CUDA the call starts after
drafting has finished and its marks end when the device holds the log phats
(`device_wait`), so "in decode" total is what the round's critical path grows by
(the features stage's CUDA-event time, `features_us_per_round`, is the GPU's idle
gap: the same quantity seen from the device). --threads 1: the decoder on one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import decode.reranker as online_reranker
import decode.round as online_round
from bench.common import CACHE, load_pair, suite_prompts, warmup_count
from bench.small_fit import small_fit_frame, small_fit_profile
from decode.config import RunConfig
from decode.loop import decode_prompt
from decode.metrics import (
    PromptTiming,
    group_metrics,
    prompt_table,
    round_table,
    timed_baseline,
    tokens_to_eos,
)
from decode.recording import record_traces
from decode.session import Arm, decode_all
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from features.extract import extract
from features.schema import candidate_store
from pairs.models import ModelPair
from pairs.prompts import Prompt, encode_prompt
from rerank.config import BoosterConfig, RerankConfig
from rerank.fit.boosting import PAPER_CAPACITY, Capacity
from rerank.fit.models import fit_reranker
from rerank.fit.persist import save_reranker
from rerank.forest.table import forest_of
from rerank.forest.walk import compile_forest, link, prepare, walk_numpy
from rerank.serving import PREDICTORS, OnlinePredictor, load_online_reranker
from rerank.settings import model_capacity
from tree.config import DecodeConfig, PoolConfig, SelectConfig

DEFAULT_FEATURE_SET = RerankConfig().feature_sets[-1]  # rows_matched: the default job's best


def settings(
    rule: str, temperature: float, budget: int, max_new: int, score: str = "tree"
) -> OnlineSettings:
    base = DecodeSettings(
        pool=PoolConfig(),
        select=SelectConfig(budget=budget),
        decode=DecodeConfig(temperature=temperature, max_new_tokens=max_new),
    )
    return OnlineSettings(base, rule, score, record=False)


def capacity_of(name: str) -> Capacity:
    """`default`: the `rerank.booster` defaults (early stopping); `paper`: the fixed 400 iterations."""
    return PAPER_CAPACITY if name == "paper" else model_capacity(BoosterConfig())


def fitted(
    pair: ModelPair, name: str, fit: list[Prompt], temperature: float, kind: str, max_new: int,
    feature_set: str = DEFAULT_FEATURE_SET, capacity: str = "default",
) -> Path:  # fmt: skip
    """A reranker for `temperature`'s law fitted on `fit` (traces and model cached).

    `feature_set` and `capacity` (`capacity_of`) as `rerank.train` fits them by default:
    what a user plugs in after `make run`.
    """
    root = CACHE / f"online-{name}-{kind}-{len(fit)}x{max_new}"
    cap = capacity_of(capacity)
    # the capacity's values in the name: a changed default refits instead of reusing
    shape = (
        f"{cap.n_iter}x{cap.learning_rate:g}x{cap.max_leaves}{'-es' if cap.early_stopping else ''}"
    )
    out = root / f"{feature_set}_{capacity}-{shape}_T{temperature:g}"
    if (out / "reranker.json").exists():
        return out
    traces, features = root / f"traces_T{temperature:g}", root / f"features_T{temperature:g}"
    t0 = time.perf_counter()
    if not (features / "manifest.json").exists():
        s = settings("draft", temperature, 59, max_new, score="record").base
        record_traces(traces, pair, fit, s, 8, {"bench": "online", "T": temperature},
                      progress=False)  # fmt: skip
        extract(traces, features, log=lambda _: None)
    frame = candidate_store(features).read().to_pandas()
    law = "greedy" if temperature == 0 else "sampling"
    t1 = time.perf_counter()
    model = fit_reranker(frame, feature_set, kind, law, n_threads=None, capacity=cap)
    t2 = time.perf_counter()
    # recording the fitting prompts dominates; the fit itself is about a second
    print(f"{kind} {law} {feature_set} reranker ({capacity} capacity, {model.n_iter} trees): "
          f"traces ready in {t1 - t0:.1f} s, fitted on {len(frame):,} candidates in "
          f"{t2 - t1:.1f} s")  # fmt: skip
    return save_reranker(model, out)


def predictor_latency(model, device: torch.device, rows: int, n: int = 300) -> dict[str, float]:
    """Median microseconds of one round's log phat (features excluded) per prediction route.

    Routes (rerank.serving.PREDICTORS) on the CPU and, if another, the decoding device;
    `numpy_walk_cpu_us`: the numpy forest walk (rerank.forest_eval.walk_numpy). Ratios:
    each route's time over the library's, in this run.
    """
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, len(model.features))).astype(np.float32)
    X[:, model.features.index("task")] = 0

    def median_us(fn) -> float:
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e6 * statistics.median(times)

    out = {}
    for route in ("library", "compiled", "forest"):
        for dev in dict.fromkeys([torch.device("cpu"), device]):
            if route == "library" and dev.type != "cpu":
                continue
            p = OnlinePredictor(model, dev, route)
            out[f"{route}_{dev.type}_us"] = median_us(lambda p=p: p.first_logprob(X).cpu())
    c = compile_forest(forest_of(model.estimator, model.kind))
    out["numpy_walk_cpu_us"] = median_us(lambda: link(c, walk_numpy(c, prepare(c, X))))
    base = out["library_cpu_us"]
    out |= {
        f"{k[:-3]}_over_library": v / base for k, v in list(out.items()) if k != "library_cpu_us"
    }
    return out


def round_cost(pair: ModelPair, prompts: list[Prompt], s: OnlineSettings, predictor,
               reps: int) -> dict:  # fmt: skip
    """Microseconds of the reranker's features and prediction of one round, by step.

    Decodes `prompts` with rule=reranker; each round's call is timed as the decoder makes
    it ("in decode"), then repeated `reps` times on the same round ("repeated": warm
    caches, the minimum). Medians over rounds (round 0, which compiles, left out).
    """
    cuda = pair.device.type == "cuda"
    real = online_round.reranker_first_factor
    decode_steps, warm_steps = [], []

    def timed(*args):
        if cuda:  # drafting done first: the marks time only what the reranker adds
            torch.cuda.synchronize(pair.device)
        marks = [time.perf_counter()]
        out = online_reranker.reranker_first_factor(*args, marks=marks)
        if cuda:  # the host returns before the device has the log phats
            torch.cuda.synchronize(pair.device)
        marks.append(time.perf_counter())
        return out, np.diff(marks)

    def probe(*args):
        out, steps = timed(*args)
        decode_steps.append(steps)
        warm_steps.append(np.min([timed(*args)[1] for _ in range(reps)], axis=0))
        return out

    online_round.reranker_first_factor = probe
    try:
        for p in prompts:
            ids = encode_prompt(pair.tokenizer, p.text)
            decode_prompt(pair.target, pair.drafter, ids, s, pair.eos_ids, p.id, p.task, predictor)
    finally:
        online_round.reranker_first_factor = real
    names = (*online_reranker.PHASES, "device_wait")
    out: dict = {"rounds": len(decode_steps) - 1}
    for label, steps in (("in_decode", decode_steps), ("repeated", warm_steps)):
        us = 1e6 * np.array(steps[1:])  # [rounds, steps]
        out[label] = {k: float(np.median(us[:, i])) for i, k in enumerate(names)}
        out[label]["total"] = float(np.median(us.sum(axis=1)))
        out[label]["features_and_predict"] = float(
            np.median(us[:, 2:].sum(axis=1))  # features, design, predict, device wait
        )
    return out


def run_rules(pair: ModelPair, prompts: list[Prompt], arms: dict[str, tuple],
              baselines: dict[str, tuple[int, float]], warmup: int = 1) -> dict[str, dict]:  # fmt: skip
    """Each rule's metrics over `prompts`; arms: rule -> (OnlineSettings, predictor).
    Decoded by `decode.session.decode_all`, as `decode.run` decodes several rules: untimed
    warm-up decodes of the first `warmup` prompts per rule, then every prompt by every rule
    in `arm_order`; the target-only baselines (`baselines`, measured once per law) beside."""
    run = RunConfig(warmup_prompts=warmup, baseline=False, progress=False)
    got = decode_all(pair, prompts, [Arm(r, s, predictor=p) for r, (s, p) in arms.items()], run)
    timings: dict[str, list[PromptTiming]] = {}
    for rule, by_budget in got.items():
        (ts,) = by_budget.values()  # every arm at its settings' one budget
        for t in ts:
            t.baseline_tokens, t.baseline_ms = baselines[t.prompt_id]
        timings[rule] = ts
    out = {}
    for rule, ts in timings.items():
        m = group_metrics(round_table(ts), prompt_table(ts, pair.eos_ids), 1000, 0)
        m["features_us_per_round"] = 1000.0 * m["ms_per_round/features"]
        m["features_us_per_round_median"] = 1000.0 * m["ms_per_round_median/features"]
        out[rule] = m
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["auto", "pocket", "tiny"], default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 59])
    ap.add_argument("--rules", nargs="+", default=["draft", "root_draw", "reranker"])
    ap.add_argument("--kind", choices=["lgbm", "hgb"], default=BoosterConfig().kind)
    ap.add_argument("--feature-set", default=DEFAULT_FEATURE_SET, help="of the fitted rerankers")
    ap.add_argument("--capacity", choices=["default", "paper"], default="default",
                    help="fitted rerankers: the job's default (early stopping) or the paper's 400")  # fmt: skip
    ap.add_argument("--cost-baseline", choices=["paper", "none"], default="paper",
                    help="per-round cost also with the paper-capacity reranker (ratios)")  # fmt: skip
    ap.add_argument("--reranker-t0")
    ap.add_argument("--reranker-t1")
    ap.add_argument("--fit-prompts", type=int, default=24)
    ap.add_argument("--rows", type=int, default=10)
    ap.add_argument("--cost-prompts", type=int, default=4, help="prompts of the per-round cost")
    ap.add_argument("--cost-reps", type=int, default=10, help="repeats of each round's call")
    ap.add_argument("--predictor", choices=list(PREDICTORS), default="auto",
                    help="run.predictor of the reranker runs")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    ap.add_argument("--warmup-prompts", type=int, default=None,
                    help="untimed decodes per rule and target-only (default 1; CUDA: all)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="4 prompts x 32 tokens, 8 fitting prompts")
    ap.add_argument("--out", type=Path, default=None, help="JSON file for the figures")
    ap.add_argument("--small-fit", type=int, default=0, metavar="N",
                    help="only profile fitting a reranker on N synthetic candidates")  # fmt: skip
    args = ap.parse_args()
    if args.small_fit:
        frame, source = small_fit_frame(args.small_fit, CACHE)
        print(f"small fit: {len(frame):,} candidates ({source}); load {os.getloadavg()[0]:.2f}")
        for kind in ("lgbm", "hgb"):
            for rec in small_fit_profile(frame, kind, "sampling"):
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in rec.items()}), flush=True)  # fmt: skip
        return
    if args.quick:
        args.prompts, args.max_new_tokens, args.fit_prompts = 4, 32, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    pair, name = load_pair(args.model, args.device, args.dtype)
    bench, fit = suite_prompts(args.prompts, args.fit_prompts)
    warmup = warmup_count(args.warmup_prompts, str(pair.device), len(bench))
    print(f"model {name} on {pair.device} ({args.dtype}); {len(bench)} prompts x "
          f"{args.max_new_tokens} tokens; {warmup} untimed warm-up prompt(s) per run")  # fmt: skip
    result: dict = {"model": name, "device": str(pair.device), "dtype": args.dtype,
                    "prompts": len(bench), "max_new_tokens": args.max_new_tokens, "runs": []}  # fmt: skip
    given = {0.0: args.reranker_t0, 1.0: args.reranker_t1}
    with torch.inference_mode():
        for t in args.temperatures:
            predictor = None
            if "reranker" in args.rules:
                path = given.get(t) or fitted(pair, name, fit, t, args.kind, args.max_new_tokens,
                                              args.feature_set, args.capacity)  # fmt: skip
                model = load_online_reranker(str(path), t, "unused")
                predictor = OnlinePredictor(model, pair.device, args.predictor)
                result[f"predictor_T{t:g}"] = {"route": predictor.route, "kind": model.kind,
                                               "predictor": args.predictor,
                                               **predictor_latency(model, pair.device, args.rows)}  # fmt: skip
                s = settings("reranker", t, max(args.budgets), args.max_new_tokens)
                costs = {"this": (model, predictor)}
                if args.cost_baseline == "paper" and not given.get(t) and args.capacity != "paper":
                    base = load_online_reranker(str(fitted(
                        pair, name, fit, t, args.kind, args.max_new_tokens, args.feature_set,
                        "paper")), t, "unused")  # fmt: skip
                    costs["paper"] = (base, OnlinePredictor(base, pair.device, args.predictor))
                for label, (m, pred) in costs.items():
                    cost = round_cost(pair, bench[: args.cost_prompts], s, pred, args.cost_reps)
                    cost["trees"] = m.n_iter
                    result[f"round_cost_T{t:g}" + ("" if label == "this" else f"_{label}")] = cost
                    print(f"T={t:g} B={max(args.budgets)} reranker features + predict of one round "
                          f"({cost['rounds']} rounds, {m.kind} {m.feature_set}, {m.n_iter} trees"
                          f"{', paper capacity' if label == 'paper' else ''}, route {pred.route}): "
                          + "; ".join(f"{lab} " + ", ".join(f"{k} {v:.0f}" for k, v in cost[lab].items())
                                      + " us" for lab in ("in_decode", "repeated")), flush=True)  # fmt: skip
                if "paper" in costs:
                    a, b = (result[f"round_cost_T{t:g}{x}"]["in_decode"] for x in ("", "_paper"))
                    print(f"T={t:g} in decode, this / paper-capacity reranker: features + predict "
                          f"{a['features_and_predict'] / b['features_and_predict']:.2f}x, "
                          f"total {a['total'] / b['total']:.2f}x", flush=True)  # fmt: skip
            baselines = {}
            warm_then_timed = [*bench[:warmup], *bench]  # the timed decodes overwrite the warm
            for p in warm_then_timed:
                out, ms = timed_baseline(pair.target, encode_prompt(pair.tokenizer, p.text),
                                         args.max_new_tokens, pair.eos_ids, t, 0, p.id)  # fmt: skip
                baselines[p.id] = (tokens_to_eos(out, pair.eos_ids), ms)
            for b in args.budgets:
                arms = {rule: (settings(rule, t, b, args.max_new_tokens),
                               predictor if rule == "reranker" else None) for rule in args.rules}  # fmt: skip
                for rule, m in run_rules(pair, bench, arms, baselines, warmup).items():
                    result["runs"].append({"T": t, "B": b, "rule": rule, **m})
                    print(f"T={t:g} B={b:>3} {rule:>9}: {m['tokens_per_s']:7.1f} tok/s  speedup "
                          f"{m['speedup']:.3f} [{m['speedup_lo']:.3f}, {m['speedup_hi']:.3f}]  tau "
                          f"{m['tau']:.3f}  features {m['features_us_per_round']:7.1f} us/round "
                          f"(median {m['features_us_per_round_median']:.1f}) "
                          f"({100 * m['features_share_of_round']:.1f}% of the round, "
                          f"{100 * m['features_over_draft']:.1f}% of drafting)", flush=True)  # fmt: skip
    for key in [k for k in result if k.startswith("predictor_")]:
        print(key, json.dumps(result[key]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"figures -> {args.out}")


if __name__ == "__main__":
    main()
