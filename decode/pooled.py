"""`python -m decode.pooled <run folder>...`: one report of an online run decoded in chunks.

    for i in 0 1 2 3; do
      python -m decode.run data.prompt_chunks=4 data.prompt_chunk=$i hydra.run.dir=runs/chunk$i ...
    done
    python -m decode.pooled runs/chunk0 runs/chunk1 runs/chunk2 runs/chunk3

A run too long for one process is split over prompt chunks (`data.prompt_chunks`, `data.prompt_chunk`:
prompt i goes to chunk i % chunks, so each keeps the task mix). Each chunk is an ordinary
`decode.run` with the same settings and seed, in its own folder; an interrupted chunk is
rerun whole, and a finished one (its `online_prompts.csv` written) need not be. Pooling
checks that the chunks' resolved configs agree except for `data.prompt_chunk`, `run.offline` and
the run's name and folders, and that no prompt is in two chunks. Then, as one interleaved run reports
them: per rule and budget the groups table (`decode.metrics.run_groups`: tau, tokens/s,
speedup over target-only with its paired prompt-bootstrap interval, ms a round per stage,
break-even tau) and the paired ratios of tau and tokens/s to the first rule
(`decode.compare.ratios_of_tables`), all over the pooled prompts. Chunks decoded with
`run.offline` (each its own recording's, or some chunks only) get the offline prediction
beside each rule's realized tau, pooled over those chunks' prompts
(`decode.predicted.offline_comparison`). `--out` writes the tables.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import yaml

from decode.compare import ratios_of_tables, ratios_text
from decode.config import without_omitted
from decode.metrics import entropy_halves, run_groups, task_entropy
from decode.predicted import offline_comparison, offline_text, offline_values
from specrank.settings.cli import READS, refusals_exit
from specrank.settings.errors import Refusal
from specrank.settings.renames import migrated_config
from specrank.store.files import atomic_write

# Keys that differ between the chunks of one run by design (dotted paths of the config).
_PER_CHUNK = ("data.prompt_chunk", "mlflow.run_name", "hydra", "paths", "run.offline")


def chunk_config(folder: Path) -> dict:
    """The settings decode.run read in a chunk (`.hydra/config.yaml`) but the per-chunk keys."""
    path = folder / ".hydra" / "config.yaml"
    if not path.is_file():
        raise Refusal(f"{folder} is not a decode.run folder: expected {path}, found none")
    # a chunk decoded before a rename compares under the new names; sections decode.run does
    # not read (the model recipes') may differ between code versions and do not matter
    raw = migrated_config(yaml.safe_load(path.read_text()))
    # a setting added later at its old behaviour reads as absent: chunks before it pool with
    # chunks after
    cfg = without_omitted({k: v for k, v in raw.items() if k in (*READS["decode.run"], "seed")})
    for key in _PER_CHUNK:
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(leaf, None)
    return cfg


def read_chunks(folders: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """The chunks' prompt and round tables stacked, checked; and their shared config."""
    if not folders:
        raise Refusal("decode.pooled needs at least one decode.run folder; got none")
    configs = [chunk_config(f) for f in folders]
    for f, c in zip(folders[1:], configs[1:], strict=True):
        if c != configs[0]:
            diff = sorted(k for k in set(c) | set(configs[0]) if c.get(k) != configs[0].get(k))
            raise Refusal(f"{f} was decoded with other settings than {folders[0]} (sections "
                          f"{diff} differ); chunks of one run differ only in data.prompt_chunk")  # fmt: skip
    unfinished = [str(f) for f in folders if not (f / "online_prompts.csv").is_file()]
    if unfinished:
        raise Refusal(f"chunks not finished (no online_prompts.csv): {unfinished}; rerun them")
    prompts, rounds = [], []
    for i, f in enumerate(folders):
        p, r = pd.read_csv(f / "online_prompts.csv"), pd.read_parquet(f / "online_rounds.parquet")
        if "rule" not in p:
            p, r = (
                p.assign(rule=configs[0]["run"]["rule"]),
                r.assign(rule=configs[0]["run"]["rule"]),
            )
        prompts.append(p.assign(chunk=i))
        rounds.append(r.assign(chunk=i))
    p_all, r_all = pd.concat(prompts, ignore_index=True), pd.concat(rounds, ignore_index=True)
    p_all["prompt_id"], r_all["prompt_id"] = (
        p_all["prompt_id"].astype(str),
        r_all["prompt_id"].astype(str),
    )
    owners = p_all.groupby("prompt_id")["chunk"].nunique()
    if (owners > 1).any():
        raise Refusal(f"prompts decoded in more than one chunk: {owners[owners > 1].index[:5].tolist()}"
                      " (chunks of one run need the same data.prompt_chunks and distinct data.prompt_chunk)")  # fmt: skip
    return p_all, r_all, configs[0]


def pooled_report(prompts: pd.DataFrame, rounds: pd.DataFrame, n_resamples: int, seed: int,
                  ) -> tuple[pd.DataFrame, pd.DataFrame, dict]:  # fmt: skip
    """(groups per rule and budget, paired ratios to the first rule, the prompt tables by
    (rule, budget)) over the pooled prompts."""
    rules = list(dict.fromkeys(prompts["rule"]))
    first = prompts[prompts["rule"] == rules[0]]
    halves = entropy_halves(task_entropy(rounds, first.drop_duplicates("prompt_id"))[0])
    groups, p_by, r_by = [], {}, {}
    for rule in rules:
        for budget in dict.fromkeys(prompts.loc[prompts["rule"] == rule, "budget"]):
            p = prompts[(prompts["rule"] == rule) & (prompts["budget"] == budget)]
            r = rounds[(rounds["rule"] == rule) & (rounds["budget"] == budget)]
            p = p.sort_values("prompt_id", kind="stable").reset_index(drop=True)
            p_by[rule, budget], r_by[rule, budget] = p, r
            g = run_groups(r, p, n_resamples, seed, halves)
            groups.append(g.assign(rule=rule, budget=budget))
    return (
        pd.concat(groups, ignore_index=True),
        ratios_of_tables(p_by, r_by, n_resamples, seed),
        p_by,
    )


def pooled_offline(folders: list[Path], prompts: pd.DataFrame, tables: dict, n_resamples: int,
                   seed: int) -> tuple[pd.DataFrame, str]:  # fmt: skip
    """Realized against offline tau over the prompts of the chunks decoded with `run.offline`
    (each rule's offline name as their `online_offline.csv` gives it), and what it read.
    `prompts`: `read_chunks`' stacked table (its `chunk` column names each row's folder)."""
    values, names, ids, sources = [], {}, set(), []
    for i, f in enumerate(folders):
        cfg = yaml.safe_load((f / ".hydra" / "config.yaml").read_text())
        if not cfg["run"].get("offline"):
            continue
        v = offline_values(cfg["run"]["offline"], cfg["mlflow"]["tracking_uri"])
        values.append(v.assign(prompt_id=v["prompt_id"].astype(str)))
        named = pd.read_csv(f / "online_offline.csv")
        names |= dict(zip(named["rule"], named["offline_rule"], strict=True))
        ids |= set(prompts.loc[prompts["chunk"] == i, "prompt_id"])
        sources.append(cfg["run"]["offline"])
    if not values:
        return pd.DataFrame(), ""
    part = {k: t[t["prompt_id"].isin(ids)].reset_index(drop=True) for k, t in tables.items()}
    source = f"{len(sources)} chunks' recordings" if len(sources) > 1 else sources[0]
    return offline_comparison(
        part,
        names,
        pd.concat(values, ignore_index=True),
        cfg["decode"]["temperature"],
        n_resamples,
        seed,
        source,
    ), source


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="decode.run folders, one per chunk")
    ap.add_argument("--out", type=Path, default=None, help="write pooled_groups.csv and "
                    "pooled_compare.csv here")  # fmt: skip
    args = ap.parse_args(argv)
    with refusals_exit():
        prompts, rounds, cfg = read_chunks(args.folders)
        n, seed = cfg["run"]["bootstrap_resamples"], cfg["seed"]
        groups, ratios, tables = pooled_report(prompts, rounds, n, seed)
        offline, source = pooled_offline(args.folders, prompts, tables, n, seed)
    cols = ["rule", "budget", "group", "prompts", "rounds", "tau", "tokens_per_s",
            "baseline_tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "break_even_tau"]  # fmt: skip
    every = groups[groups["group"] == "all"]
    print(f"pooled {len(args.folders)} chunks, {prompts['prompt_id'].nunique()} prompts")
    print(every[[c for c in cols if c in every]].to_string(index=False))
    if prompts["rule"].nunique() > 1:
        print(ratios_text(ratios))
    if not offline.empty:
        print(offline_text(offline, source))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out / "pooled_groups.csv", lambda t: groups.to_csv(t, index=False))
        atomic_write(args.out / "pooled_compare.csv", lambda t: ratios.to_csv(t, index=False))
        if not offline.empty:
            atomic_write(args.out / "pooled_offline.csv", lambda t: offline.to_csv(t, index=False))


if __name__ == "__main__":
    main()
