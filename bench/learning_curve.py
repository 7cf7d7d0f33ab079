"""`python -m bench.learning_curve`: held-out error and learned rules' values against training rows.

    python -m bench.learning_curve                                  # make run's pocket store
    python -m bench.learning_curve --traces <store> --features <table>
    python -m bench.learning_curve --synthetic 154                  # 154 prompts x 261 rounds

For each share of every training half's prompts (`rerank.train_share`: 1/8, 1/4, 1/2, 1,
stratified by task; the other half is always predicted whole), the default job's
rerankers are cross-fitted on that share and every rule evaluated as `rerank.train` does.
It prints, per law and learned rule: the training prompts per half, the held-out squared error of phat
(all rows), and the round-weighted gain over draft at each budget, beside the same at the
full share. `rerank.train_share` (default 1.0) is chosen from these curves: a share whose
gains stay within 0.1 points of the full fit's at every law and budget would do as well.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd

from rerank.config import RerankConfig
from rerank.job.evaluation import evaluate
from rerank.job.fitting import fit
from rerank.settings import check_settings, store_budgets

SHARES = (0.125, 0.25, 0.5, 1.0)


def curve(traces: Path, features: Path, shares: tuple[float, ...], seed: int = 0) -> pd.DataFrame:
    """One row per share, law, learned rule and budget: training prompts, error, gain."""
    rows = []
    for share in shares:
        cfg = RerankConfig(traces=str(traces), features=str(features), reports=False,
                           calibrators=["rank_control"], train_share=share)  # fmt: skip
        check_settings(cfg)
        budgets = store_budgets(cfg)
        t0 = time.perf_counter()
        fitted = fit(cfg, seed)
        ev = evaluate(replace(cfg, budgets=budgets), fitted, seed, budgets)
        secs = time.perf_counter() - t0
        quality = fitted.quality[fitted.quality["fold"] == "all"].set_index(
            ["temperature", "predictor"]
        )["squared_error"]
        # prompts per training half (what the share cuts), the two halves' mean
        n_train = {(k.rsplit("/T", 1)[0], float(k.rsplit("/T", 1)[1])):
                   sum(len(m.train_prompts) for m in pair) / 2
                   for k, pair in fitted.preds.models.items()}  # fmt: skip
        summary = ev.summary[ev.summary["weighting"] == "round"]
        for r in summary[summary["rule"].str.endswith("_lgbm")].itertuples():
            t = 0.0 if r.law == "greedy" else 1.0
            rows.append({"share": share, "law": r.law, "rule": r.rule, "budget": r.budget,
                         "train_prompts": n_train.get((r.rule, t)),
                         "squared_error": quality.get((t, r.rule)), "gain": r.gain,
                         "seconds": secs})  # fmt: skip
    out = pd.DataFrame(rows)
    full = out[out["share"] == 1.0].set_index(["law", "rule", "budget"])["gain"]
    at_full = out.set_index(["law", "rule", "budget"]).index.map(full)
    out["gain_minus_full_points"] = 100 * (out["gain"].to_numpy() - at_full.to_numpy(float))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", type=Path, default=Path("data_out/traces"))
    parser.add_argument("--features", type=Path, default=Path("data_out/features"))
    parser.add_argument("--synthetic", type=int, default=None,
                        help="synthetic traces of this many prompts x 261 rounds instead")  # fmt: skip
    parser.add_argument("--shares", type=float, nargs="+", default=list(SHARES))
    args = parser.parse_args()
    traces, features = args.traces, args.features
    if args.synthetic is not None:
        from bench.bench_extract import paper_traces
        from bench.bench_rerankers import paper_features

        traces, features = paper_traces(args.synthetic, 261), paper_features(args.synthetic, 261)
    table = curve(traces, features, tuple(args.shares))
    pd.set_option("display.width", 160)
    cols = ["share", "law", "rule", "budget", "train_prompts", "squared_error", "gain",
            "gain_minus_full_points", "seconds"]  # fmt: skip
    print(f"learning curve on {traces} (train_prompts: per training half)")
    print(table[cols].sort_values(["law", "rule", "budget", "share"]).to_string(index=False))


if __name__ == "__main__":
    main()
