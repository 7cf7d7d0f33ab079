"""Every command line the README (and the logs it links to, `DOCS`) shows is run (issue 30):
composed, parsed or dry-run.

See `tests/readme_commands.py` for what each kind of line becomes. The Python ones run in
one subprocess (one import of torch and Hydra for all of them); `make` lines run as
`make -n`. A README block tagged `<!-- commands: exempt (why) -->` is listed here, with
its reason, and nothing else is skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.readme_commands import ROOT, Command, plan, readme_commands

# What the README tags exempt, and why (a new exempt block must be added here on purpose).
EXEMPT = {"make dashboard": "browser: it serves the MLflow UI until Ctrl-C"}


def test_the_readme_commands_are_found():
    cmds = readme_commands()
    lines = [c.line for c in cmds]
    assert (
        "python -m decode.synth_traces synth_job.toy_prompts=1402 synth_job.rounds_per_prompt=261"
        in lines
    )
    assert any(line.startswith("python -m decode.record -m launcher=slurm") for line in lines)
    # and a line only the linked measurement log shows (`DOCS`)
    assert any(line.startswith("python -m bench.stage_memory ") for line in lines)
    assert {c.line: c.exempt for c in cmds if c.exempt} == EXEMPT


def test_the_parser_joins_continuations_cuts_comments_and_reads_tags():
    text = (
        "x `python -m rerank.train a=1` y\n<!-- commands: exempt (cuda) -->\n```bash\n"
        "# a comment\npython -m decode.record b=2 \\\n    c=3   # why\n```\n```bash\nmake run\n```\n"
    )
    assert readme_commands(text) == [
        Command("python -m rerank.train a=1"),
        Command("python -m decode.record b=2 c=3", "cuda"),
        Command("make run"),
    ]


def test_plans(tmp_path):
    sweep = plan(Command("python -m rerank.train -m booster=hgb,lgbm"), tmp_path)
    assert [c["argv"] for c in sweep] == [["booster=hgb", "--cfg", "job"],
                                          ["booster=lgbm", "--cfg", "job"]]  # fmt: skip
    (make,) = plan(Command('make run RUN_ARGS="debug=default paths.traces=<dir>"'), tmp_path)
    assert make["argv"] == [
        "make",
        "-n",
        "run",
        f"RUN_ARGS=debug=default paths.traces={tmp_path}/dir0",
    ]
    (loop,) = plan(Command("for i in 1 2; do python -m features.extract & done; wait"), tmp_path)
    assert loop["module"] == "features.extract"


def test_every_readme_command_runs(tmp_path):
    cmds = [c for c in readme_commands() if not c.exempt]
    checks = [(c, p) for c in cmds for p in plan(c, tmp_path)]
    python = [p for _, p in checks if p["kind"] != "make"]
    # two lines that must fail, so the check is seen to fail: a misspelt key, a wrong flag
    bad = [
        plan(Command(line), tmp_path)[0]
        for line in (
            "python -m rerank.train rerank.budgetz=[8]",
            "python -m bench.bench_store --nope",
        )
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "readme_commands.py")],
        input=json.dumps(python + bad), capture_output=True, text=True, cwd=tmp_path, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    found = json.loads(line.removeprefix("RESULTS "))
    assert [r["code"] != 0 for r in found[-2:]] == [True, True], found[-2:]
    assert "Did you mean 'rerank.budgets'" in found[-2]["stderr"]
    results = iter(found[:-2])
    failed = []
    for cmd, p in checks:
        if p["kind"] == "make":
            r = subprocess.run(p["argv"], cwd=ROOT, capture_output=True, text=True, timeout=60)
            res = {"code": r.returncode, "stderr": r.stderr[-1000:]}
        else:
            res = next(results)
        if res["code"] != 0:
            failed.append(f"{cmd.line}\n  ran: {p['argv']}\n  {res['stderr'][-800:]}")
    assert not failed, "README commands that fail:\n" + "\n".join(failed)
    assert len(checks) >= 30


@pytest.mark.slow
def test_make_run_at_debug_size(tmp_path):
    """The README's own `make run RUN_ARGS="debug=default ..."` line, for real."""
    args = f"debug=default paths.traces={tmp_path}/t paths.features={tmp_path}/f " + (
        f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db data.sources.0.limit=4 "
        "data.sources.1.limit=4"
    )
    r = subprocess.run(["make", "run", f"RUN_ARGS={args}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "gain vs draft" in r.stdout
