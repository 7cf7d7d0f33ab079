"""`python -m bench.offline_online`: does the offline figure predict the online one, and what
does a learned rule pay off in tokens/s, on a suite the models never saw.

    python -m bench.offline_online --rerankers outputs/train/<date>/<time>/rerankers
    python -m bench.offline_online --rerankers <dir> --prompts 100 --temperature 1
    python -m bench.offline_online --rerankers <dir> --score top_m --top-m 32

Each step is the project's own command (a subprocess), in one folder (--out):
1. the suite: --prompts prompts of `data=heldout`, as many per task, each task's taken
   round-robin over its categories in file order (`suite.jsonl`);
2. `decode.record` of them at --budget and --temperature: draft's trees at the budget an
   online decoder runs, so the features are that budget's;
3. `features.extract`, then `rerank.transfer` of --rerankers (fold 0; fitted on another
   suite) at --budget: the offline prediction per round. A rule that reads no matched row
   (draft, rows) keeps its trees and features whatever else a pass scores, so its offline
   value is the same under every policy; one that does (rows_matched) is simulated on its
   own trees under `rerank.score=--score` (rerank.evaluate.matched);
4. `decode.run run.rules=[draft, reranker:<fold 0 of --feature-set>]` on the same prompts
   under `run.score=--score`, with `run.offline=` the transfer run: both rules decode every
   prompt in alternating order in one run, and it prints tokens per pass and tokens/s
   against draft with paired prompt-bootstrap intervals, and each rule's realized minus
   predicted tau with its interval. Under --score top_m a third rule, `draft@+M`, decodes
   at B + M scoring its tree only: draft at as many scored prefixes a pass (the
   practical baseline of App. D.10's Theorem 2), beside its offline prediction
   (`draft_scored`); --no-draft-at-b-plus-m leaves it out.
`--overrides` go to every command (`--overrides model=smollm2 experiment=smollm2`: the real
pair), `--extra-rules` join the online rules (`draft@-4`: draft at B - 4 in the same run).
`--chunks N` runs steps 2-4 per prompt chunk (`data.prompt_chunks`: every chunk its own recording,
transfer and `decode.run` folder; `--offline-chunks K`: steps 2-3 for the first K chunks
only) and pools the online runs with `python -m decode.pooled`, the offline prediction
over the chunks that have one. Rerunning the same
command resumes: the recording keeps its finished prompts, a finished transfer or chunk is
not redone.
The figures are CPU figures on this machine: run it alone and give the load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from pairs.config import DataConfig
from pairs.prompts import Prompt, load_prompts
from selection.policies import SCORE_MODES
from specrank.settings.paths import CONF_DIR, project_path


def heldout_subset(n: int) -> list[Prompt]:
    """n prompts of `data=heldout`, as many per task (the first tasks take the remainder),
    each task's taken round-robin over its categories in file order."""
    raw = OmegaConf.merge(
        OmegaConf.structured(DataConfig), OmegaConf.load(CONF_DIR / "data/heldout.yaml")
    )
    by_task: dict[str, dict[str, list[Prompt]]] = {}
    for p in load_prompts(OmegaConf.to_object(raw)):
        by_task.setdefault(p.task, {}).setdefault(p.category, []).append(p)
    out = []
    for i, cats in enumerate(by_task.values()):
        want = n // len(by_task) + (i < n % len(by_task))
        queues = [list(c) for c in cats.values()]
        while want and any(queues):
            for q in queues:
                if q and want:
                    out.append(q.pop(0))
                    want -= 1
    return out


def _run(args: list[str], log: Path) -> None:
    """One project command, its output to `log`; a failure stops the bench naming the log."""
    # as under `make run`: every step keeps the --overrides it reads (SPECRANK_ROUTED)
    env = {**os.environ, "SPECRANK_ROUTED": "1"}
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", *args], stdout=f, stderr=subprocess.STDOUT, env=env
        ).returncode
    if rc != 0:
        sys.exit(f"{args[0]} failed (exit {rc}); its output: {log}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rerankers", required=True, help="a rerank.train run's rerankers/ folder")
    ap.add_argument("--feature-set", default="rows", help="the learned rule against draft")
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--score", choices=SCORE_MODES, default="tree")
    ap.add_argument("--top-m", type=int, default=100, help="M of --score top_m")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-at-b-plus-m", action=argparse.BooleanOptionalAction, default=True,
                    help="under --score top_m, also draft at B + M (scoring its tree only)")  # fmt: skip
    ap.add_argument("--overrides", nargs="*", default=[], help="Hydra overrides of every step")
    ap.add_argument("--extra-rules", nargs="*", default=[], help="more online rules (draft@-4)")
    ap.add_argument("--chunks", type=int, default=1, help="online prompt chunks, pooled")
    ap.add_argument(
        "--offline-chunks",
        type=int,
        default=None,
        help="the first K chunks get the offline prediction (default: all)",
    )
    ap.add_argument("--out", default="bench_out/offline_online")
    a = ap.parse_args(argv)
    a.offline_chunks = a.chunks if a.offline_chunks is None else a.offline_chunks
    policy_name = f"top_m{a.top_m}" if a.score == "top_m" else a.score
    out = project_path(a.out) / f"t{a.temperature:g}_b{a.budget}_{policy_name}"
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "suite.jsonl"
    suite.write_text("".join(json.dumps({"id": p.id, "task": p.task, "prompt": p.text}) + "\n"
                             for p in heldout_subset(a.prompts)))  # fmt: skip
    data = ["data.name=heldout_subset", f"data.sources=[{{kind:jsonl,path:'{suite}'}}]"]
    law = [f"select.budget={a.budget}", f"decode.temperature={a.temperature:g}",
           f"decode.max_new_tokens={a.max_new_tokens}"]  # fmt: skip
    common = [*a.overrides, *data, *law]
    model = f"{a.feature_set}_lgbm_T{a.temperature:g}_fold0"
    rules = ["draft", f"reranker:{Path(a.rerankers) / model}", *a.extra_rules]
    if a.score == "top_m" and a.draft_at_b_plus_m:
        rules.append(f"draft@+{a.top_m}")
    online = ["decode.run", f"run.rules=[{','.join(rules)}]", *common, f"run.score={a.score}",
              f"run.score_top_m={a.top_m}", "run.progress=false"]  # fmt: skip
    if a.chunks == 1:
        _offline_prediction(a, common, out)
        _run([*online, f"run.offline={out / 'transfer'}", f"hydra.run.dir={out / 'online'}"],
             out / "online.log")  # fmt: skip
        print((out / "online.log").read_text())
        return
    folders = [out / "online" / f"chunk{i}" for i in range(a.chunks)]
    for i, folder in enumerate(folders):
        chunk = [f"data.prompt_chunks={a.chunks}", f"data.prompt_chunk={i}"]
        offline = []
        if i < a.offline_chunks:
            where = out / f"chunk{i}"
            _offline_prediction(a, [*common, *chunk], where)
            offline = [f"run.offline={where / 'transfer'}"]
        if not (folder / "online_prompts.csv").is_file():
            _run([*online, *chunk, *offline, f"hydra.run.dir={folder}"],
                 out / f"online_chunk{i}.log")  # fmt: skip
    _run(["decode.pooled", *map(str, folders), "--out", str(out / "online")], out / "pooled.log")
    print((out / "pooled.log").read_text())


def _offline_prediction(a: argparse.Namespace, common: list[str], out: Path) -> None:
    """Steps 2-3 into `out`: record the prompts, extract, and the rerankers' transfer run
    (skipped when its values exist; the recording resumes by itself)."""
    if (out / "transfer" / "per_round_values.parquet").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    traces, features = out / "traces", out / "features"
    _run(["decode.record", *common, f"paths.traces={traces}", "trace.progress=false",
          f"hydra.run.dir={out / 'record'}"], out / "record.log")  # fmt: skip
    _run(["features.extract", *a.overrides, f"traces={traces}", f"out={features}"],
         out / "extract.log")  # fmt: skip
    policy = [f"rerank.score={a.score}", f"rerank.score_top_m={a.top_m}"]
    _run(["rerank.transfer", *a.overrides, f"transfer.rerankers={a.rerankers}",
          f"paths.traces={traces}", f"paths.features={features}", f"rerank.budgets=[{a.budget}]",
          *policy, f"hydra.run.dir={out / 'transfer'}"], out / "transfer.log")  # fmt: skip


if __name__ == "__main__":
    main()
