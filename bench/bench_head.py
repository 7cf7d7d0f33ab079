"""`python -m bench.bench_head`: a trained head's decoding figures on held-out prompts, by
`decode.run` itself (one interleaved run per law: draft at each budget and target-only).

    python -m bench.bench_head --card                   # model=smollm2: record them in its card
    python -m bench.bench_head --prompts 4 --max-new-tokens 32 --laws 0
    python -m bench.bench_head --card --model smollm2_dspark   # a block-family drafter's card

Each law's run decodes the first `--prompts` prompts of `data=heldout` (Spec-Bench's first
turns, which the head never trained on) with rule=draft at B = 8 and 59 and target-only, in
the model config's dtype on one CPU thread (`run.torch_threads`), and prints decode.run's
own report. The figures read back are its groups table's: tau, tokens/s and the speed-up
over target-only with its paired prompt-bootstrap interval, and the break-even tau. With
`--card` they go into the head's recipe.json under "suite" and its MODEL_CARD.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from specrank.settings.paths import PROJECT_ROOT


def law_run(args: argparse.Namespace, temperature: float, out: Path) -> pd.DataFrame:
    """One decode.run at `temperature`; its groups table (all prompts)."""
    cmd = [
        sys.executable, "-m", "decode.run", f"model={args.model}", f"experiment={args.experiment}",
        "data=heldout", f"data.sources.0.limit={args.prompts}",
        f"decode.temperature={temperature}", f"decode.max_new_tokens={args.max_new_tokens}",
        f"run.budgets=[{','.join(map(str, args.budgets))}]", "run.progress=false",
        f"hydra.run.dir={out}", "mlflow.run_name=bench_head",
    ]  # fmt: skip
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run(cmd, check=True, cwd=PROJECT_ROOT, env=env)
    groups = pd.read_csv(next(out.rglob("online_groups.csv")))
    return groups[groups["group"] == "all"]


def card_rows(groups: pd.DataFrame, law: str) -> list[dict]:
    cols = ("tau", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "break_even_tau")
    return [
        {"law": law, "rule": "draft", "budget": int(g["budget"])} | {c: float(g[c]) for c in cols}
        for _, g in groups.iterrows()
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", default="smollm2", help="a conf/model whose drafter was trained here"
    )
    ap.add_argument(
        "--experiment", default="smollm2",
        help="the conf/experiment (pool, store) decoding with it: SmolLM2's serves every kind",
    )  # fmt: skip
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 59])
    ap.add_argument("--laws", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--card", action="store_true", help="write the figures into the head's card")
    args = ap.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in args.laws:
            rows += card_rows(law_run(args, t, Path(tmp) / f"T{t:g}"), f"T={t:g}")
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    print(pd.DataFrame(rows).to_string(index=False))
    print(f"load before {' '.join(load)}, after {' '.join(load_after)}")
    if args.card:
        write_suite(args, rows, f"{load[0]} -> {load_after[0]}")


def write_suite(args: argparse.Namespace, rows: list[dict], load: str) -> None:
    from omegaconf import OmegaConf

    from recipes.block_head import card as block_card
    from recipes.eagle3 import card as head_card

    model = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / f"{args.model}.yaml")
    write_card = head_card.write_card if model.drafter_kind == "eagle3" else block_card.write_card
    folder = PROJECT_ROOT / model.drafter
    facts = json.loads((folder / "recipe.json").read_text())
    facts["suite"] = {
        "command": " ".join(["python -m bench.bench_head --card"]
                            + ([f"--model {args.model}"] if args.model != "smollm2" else [])),
        "date": time.strftime("%Y-%m-%d"),
        "load": load, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
        "dtype": model.dtype, "threads": 1, "rows": rows,
    }  # fmt: skip
    write_card(folder, facts)


if __name__ == "__main__":
    main()
