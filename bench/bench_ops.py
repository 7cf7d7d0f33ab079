"""`python -m bench.bench_ops`: the PyTorch ops one decoding round dispatches, stage by stage.

    python -m bench.bench_ops                                   # 4 pocket kinds, B=8 and 59
    python -m bench.bench_ops --kinds eagle3 --budgets 8 --prompts 1 --tokens 16
    python -m bench.bench_ops --baseline /tmp/base --repeats 2  # beside another code tree
    python bench/bench_ops.py --tree /tmp/base --json base.json # one run by that tree's code

Each pocket pair (conf/model/<name>.yaml of `KINDS`) decodes a few prompts of
data/prompts/sharegpt_heldout.jsonl greedily (rule=draft, run.score=tree, the default pool,
`select.budget` = B, the drafted nodes verified beside the root) on the CPU in one torch
thread, three times: untimed with each round's pool digested (sha256 of its tensors: the
JSON's `pools`), timed by the decoder's own stage clocks, and under a `TorchDispatchMode`
that counts every aten op dispatched, its stage boundaries from those clocks
(`decode.round.StageClock` is wrapped here), so ops and ms split the round alike: draft,
root_pass, features, select, verify, bookkeeping. Per kind and budget it prints `<kind>
B=<b>: <n> ops` (n: the draft stage's ops in a round), then ops and ms per stage, medians.

--baseline TREE runs the count in child processes, one per tree and repeat, alternating,
prints current/baseline per stage and whether the current tree's pools and emitted tokens
were the baseline's bit for bit, round by round (first runs). Each child runs this file on
its tree's code: `--tree` puts that tree's packages first on sys.path (this file imports
the project only inside its functions for that reason). Op counts do not depend on the
machine; the ms do: give the load beside them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

if TYPE_CHECKING:  # the project is imported inside the functions (`tree_first`)
    from decode.round import RoundRecord
    from pairs.models import ModelPair

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
PROMPTS = "data/prompts/sharegpt_heldout.jsonl"
# kind -> conf/model/<name>.yaml, as `bench.drafters.KINDS`; kept here because a child runs
# this file on another tree's code, which may not have that module
KINDS = {"standalone": "pocket", "eagle3": "pocket_eagle3", "block": "pocket_block",
         "dcore": "pocket_block_dcore"}  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while it is active: per round and stage between a
    `begin_round` and the mark that closes the last stage, else as `outside`."""

    def __init__(self, stages: tuple[str, ...]) -> None:
        super().__init__()
        self.stages = stages
        self.stage: int | None = None  # index into stages; None: outside a round
        self.rounds: list[list[int]] = []  # ops per stage, a list per round
        self.outside = 0
        self.by_op: Counter[tuple[str, str]] = Counter()  # (stage, op) over every round

    def begin_round(self) -> None:
        self.rounds.append([0] * len(self.stages))
        self.stage = -1  # the clock's first mark opens stage 0

    def mark(self) -> None:
        if self.stage is None:
            return
        self.stage += 1
        if self.stage == len(self.stages):
            self.stage = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stage is None or self.stage < 0:
            self.outside += 1
        else:
            self.rounds[-1][self.stage] += 1
            self.by_op[self.stages[self.stage], str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], object]) -> int:
    """The ops `fn()` dispatches (outside any round)."""
    with OpCounter(()) as counter:
        fn()
    return counter.outside


@contextmanager
def stage_marks(counter: OpCounter) -> Iterator[None]:
    """Rounds decoded inside count their ops by stage: each round's clock opens a round on
    the counter and every mark of the clock (a stage's end, decode.round) moves it on."""
    import decode.round as online_round

    base = online_round.StageClock

    class CountingClock(base):
        def __init__(self, device: torch.device) -> None:
            counter.begin_round()
            super().__init__(device)

        def mark(self) -> None:
            counter.mark()
            super().mark()

    online_round.StageClock = CountingClock
    try:
        yield
    finally:
        online_round.StageClock = base


def tree_first(tree: Path) -> None:
    """`tree`'s packages first on sys.path and `tree` the working directory, before any
    project import; this file's own folder off the path (its modules are not top-level)."""
    loaded = sys.modules.get("specrank")
    if loaded is not None and Path(loaded.__file__).resolve().parents[1] != tree:
        # `python -m bench.bench_ops` imported the packages of the tree it ran from
        raise SystemExit(f"--tree {tree}: run this file as a script, python bench/bench_ops.py")
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]
    sys.path.insert(0, str(tree))
    os.chdir(tree)


def read_prompts(path: Path, n: int) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line, _ in zip(f, range(n), strict=False)]


def load_kind(kind: str) -> ModelPair:
    """The pocket pair of a drafter kind, from the code tree's own conf/model and models/."""
    import dataclasses

    from omegaconf import OmegaConf

    from pairs.config import ModelConfig
    from pairs.models import load_model_pair
    from specrank.settings.paths import PROJECT_ROOT, project_path

    yaml = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / f"{KINDS[kind]}.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    cfg = dataclasses.replace(cfg, target=str(project_path(cfg.target)),
                              drafter=str(project_path(cfg.drafter)), device="cpu",
                              dtype="float32")  # fmt: skip
    return load_model_pair(cfg)


def decode_rounds(
    pair: ModelPair, encoded: list[list[int]], budget: int, tokens: int
) -> list[RoundRecord]:
    """Every prompt decoded greedily with the draft rule at `budget`: the rounds, in order."""
    from decode.loop import decode_prompt
    from decode.settings import OnlineSettings
    from decode.stream import DecodeSettings
    from tree.config import DecodeConfig, PoolConfig, SelectConfig

    base = DecodeSettings(PoolConfig(), SelectConfig(budget=budget),
                          DecodeConfig(temperature=0.0, max_new_tokens=tokens))  # fmt: skip
    s = OnlineSettings(base, rule="draft", score="tree")
    return [r for ids in encoded for r in decode_prompt(
        pair.target, pair.drafter, ids, s, pair.eos_ids, "0").rounds]  # fmt: skip


POOL_FIELDS = ("token", "parent", "depth", "draft_logprob", "score", "expanded", "anc",
               "drafter_pos")  # fmt: skip


@contextmanager
def pool_digests(out: list[dict[str, str]]) -> Iterator[None]:
    """Every pool drafted inside (decode.round's `draft_pool`) appends its fields' digests."""
    import decode.round as online_round

    def digest(t: torch.Tensor) -> str:
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()[:16]

    def digested(*args, **kwargs):
        pool = base(*args, **kwargs)
        out.append({f: digest(getattr(pool, f)) for f in POOL_FIELDS})
        return pool

    base, online_round.draft_pool = online_round.draft_pool, digested
    try:
        yield
    finally:
        online_round.draft_pool = base


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def measure(pair: ModelPair, encoded: list[list[int]], budget: int, tokens: int) -> dict:
    """One kind at one budget: a warm-up decode (pools digested), the timed decodes, the
    counted decodes (the same greedy rounds again). Medians per round of every stage."""
    from decode.round import STAGES

    pools: list[dict[str, str]] = []
    with pool_digests(pools):  # untimed: first-call costs, and the pools' digests
        digested = decode_rounds(pair, encoded, budget, tokens)
    timed = decode_rounds(pair, encoded, budget, tokens)
    counter = OpCounter(STAGES)
    with stage_marks(counter), counter:
        counted = decode_rounds(pair, encoded, budget, tokens)
    emitted = [r.emitted for r in digested]
    if not [r.emitted for r in counted] == [r.emitted for r in timed] == emitted:
        raise RuntimeError("the counted, timed and digested decodes emitted other tokens")
    n = len(counter.rounds)
    ms = [list(r.stage_ms) for r in timed]
    return {
        "rounds": n,
        "stages": list(STAGES),
        "ops": {st: _median([r[i] for r in counter.rounds]) for i, st in enumerate(STAGES)},
        "ms": {st: _median([r[i] for r in ms]) for i, st in enumerate(STAGES)},
        "ops_round": _median([sum(r) for r in counter.rounds]),
        "ms_round": _median([sum(r) for r in ms]),
        "per_round_ops": counter.rounds,
        "top_ops": {st: _top(counter, st, n) for st in STAGES},
        "pools": pools,
        "emitted": emitted,
    }


def _top(counter: OpCounter, stage: str, rounds: int, k: int = 8) -> list[list]:
    """The stage's k most dispatched ops: [name, mean count a round]."""
    ops = [[op, c / rounds] for (s, op), c in counter.by_op.most_common() if s == stage]
    return ops[:k]


def run_here(args: argparse.Namespace) -> dict:
    """Every kind and budget asked for, measured by the code this process imported."""
    import transformers

    from pairs.prompts import encode_prompt

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    load, t0 = os.getloadavg(), time.perf_counter()
    texts = [p["prompt"] for p in read_prompts(args.prompt_file, args.prompts)]
    results = []
    for kind in args.kinds:
        pair = load_kind(kind)
        encoded = [encode_prompt(pair.tokenizer, t) for t in texts]
        for b in args.budgets:
            results.append({"kind": kind, "budget": b,
                            **measure(pair, encoded, b, args.tokens)})  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"  # fmt: skip
    return {"tree": str(Path.cwd()), "commit": commit, "threads": args.threads,
            "torch": torch.__version__, "load_start": load, "load_end": os.getloadavg(),
            "seconds": time.perf_counter() - t0, "prompts": len(texts), "tokens": args.tokens,
            "results": results}  # fmt: skip


def run_child(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One run by `tree`'s code in a fresh interpreter, measured by this file."""
    cmd = [sys.executable, str(HERE), "--tree", str(tree), "--json", str(out),
           "--prompt-file", str(args.prompt_file), "--prompts", str(args.prompts),
           "--tokens", str(args.tokens), "--threads", str(args.threads),
           "--kinds", *args.kinds, "--budgets", *map(str, args.budgets)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_WAIT_POLICY": "PASSIVE"}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the run in {tree} exited {done.returncode}: {done.stderr[-3000:]}")
    return json.loads(out.read_text())


def interleaved(args: argparse.Namespace) -> dict[str, list[dict]]:
    """`--repeats` runs of each tree, baseline and current alternating, each its own process."""
    trees = {"baseline": args.baseline.resolve(), "current": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        for rep in range(args.repeats):
            for name, tree in trees.items():
                run = run_child(tree, args, Path(tmp) / f"{name}-{rep}.json")
                runs[name].append(run)
                print(f"run {rep + 1}/{args.repeats} {name} ({tree}, {run['commit']}): "
                      f"{run['seconds']:.0f} s, load {run['load_start'][0]:.2f}", flush=True)  # fmt: skip
    return runs


def summary(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """(kind, budget) -> stage medians over the runs of one tree (each run's own medians)."""
    out = {}
    for res in runs[0]["results"]:
        key = (res["kind"], res["budget"])
        same = [r for run in runs for r in run["results"] if (r["kind"], r["budget"]) == key]
        cells = {f: {st: _median([r[f][st] for r in same]) for st in res["stages"]}
                 for f in ("ops", "ms")}  # fmt: skip
        cells["ops"]["round"] = _median([r["ops_round"] for r in same])
        cells["ms"]["round"] = _median([r["ms_round"] for r in same])
        out[key] = cells | {"rounds": res["rounds"]}
    return out


def same_pools(runs: dict[str, list[dict]]) -> list[str]:
    """Per kind and budget: did the current tree's first run draft the baseline's first run's
    pools and emit its tokens, round by round?"""
    base = {(r["kind"], r["budget"]): r for r in runs["baseline"][0]["results"]}
    lines = []
    for cur in runs["current"][0]["results"]:
        key = (cur["kind"], cur["budget"])
        a, b = cur["pools"], base[key].get("pools", [])
        differ = sorted({f for x, y in zip(a, b, strict=False) for f in POOL_FIELDS
                         if x[f] != y[f]})  # fmt: skip
        same = not differ and len(a) == len(b) and cur["emitted"] == base[key]["emitted"]
        lines.append(f"{key[0]} B={key[1]}: " + (
            f"pools and emitted tokens bit for bit the baseline's in all {len(a)} rounds" if same
            else f"DIFFERENT from the baseline: {len(a)} / {len(b)} rounds, fields {differ}, "
                 f"emitted tokens {'equal' if cur['emitted'] == base[key]['emitted'] else 'differ'}"))  # fmt: skip
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else ("1.000" if a == b else "-")


def block_text(kind: str, budget: int, cur: dict, base: dict | None = None) -> list[str]:
    """`<kind> B=<b>: <n> ops` (the draft stage's), then the per-stage table."""
    lines = [f"{kind} B={budget}: {cur['ops']['draft']:.0f} ops"]
    head = f"  {'stage':<12} {'ops':>8} {'ms':>8}"
    if base is not None:
        head += f" {'base ops':>9} {'base ms':>8} {'ops x':>7} {'ms x':>7}"
    lines.append(head + f"   ({cur['rounds']} rounds, medians per round)")
    for st in cur["ops"]:
        row = f"  {st:<12} {cur['ops'][st]:8.0f} {cur['ms'][st]:8.3f}"
        if base is not None:
            row += (f" {base['ops'][st]:9.0f} {base['ms'][st]:8.3f}"
                    f" {_ratio(cur['ops'][st], base['ops'][st]):>7}"
                    f" {_ratio(cur['ms'][st], base['ms'][st]):>7}")  # fmt: skip
        lines.append(row)
    return lines


def report(runs: dict[str, list[dict]]) -> str:
    cur = summary(runs["current"])
    base = summary(runs["baseline"]) if "baseline" in runs else {}
    lines = []
    for (kind, b), cells in cur.items():
        lines += block_text(kind, b, cells, base.get((kind, b)))
    if base:
        lines.append("x: current / baseline, medians over each tree's runs")
        lines += same_pools(runs)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 59],
                    help="select.budget: drafted nodes verified beside the root")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-file", type=Path, default=None, help=f"default: <tree>/{PROMPTS}")
    ap.add_argument("--baseline", type=Path, default=None, help="a code tree to count beside")
    ap.add_argument("--repeats", type=int, default=2, help="runs per tree with --baseline")
    ap.add_argument("--tree", type=Path, default=None, help="count with this tree's code")
    ap.add_argument("--json", type=Path, default=None, help="write the runs' figures here")
    args = ap.parse_args(argv)
    if args.baseline is not None and args.tree is not None:
        ap.error("--baseline runs its trees as children; give it without --tree")
    args.tree = (args.tree or ROOT).resolve()
    args.prompt_file = (args.prompt_file or args.tree / PROMPTS).resolve()
    args.json = args.json.resolve() if args.json else None  # before a chdir
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(f"{args.prompts} prompts of {args.prompt_file.name} x {args.tokens} tokens, T=0, "
          f"rule=draft, score=tree, float32 CPU, {args.threads} thread(s); load average "
          "{:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg()), flush=True)  # fmt: skip
    if args.baseline is not None:
        runs = interleaved(args)
    else:
        tree_first(args.tree)
        runs = {"current": [run_here(args)]}
    print(report(runs))
    print("load average {:.2f}, {:.2f}, {:.2f} at the end".format(*os.getloadavg()))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(runs if args.baseline else runs["current"][0], indent=1))
    return runs


if __name__ == "__main__":
    main()
