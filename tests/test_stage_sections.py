"""Each command accepts only the config sections it reads (`specrank.settings.cli.READS`).

An override of another stage's section is refused naming the command and the commands
that read it; `make run`'s SPECRANK_ROUTED=1 leaves such overrides to the other stages.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrank.settings.cli import (
    EVERY_COMMAND,
    READS,
    ROUTED_ENV,
    route,
    stage_override_message,
    unknown_key_message,
)
from specrank.settings.config import schema

ROOT = Path(__file__).resolve().parents[1]
KNOWN = {f.name for f in dataclasses.fields(schema())}
# where each command's `main(cfg)` is
MAINS = {
    "decode.record": "decode/record.py",
    "decode.run": "decode/run.py",
    "decode.synth_traces": "recipes/synth/job.py",
    "features.extract": "features/extract.py",
    "rerank.train": "rerank/train.py",
    "rerank.transfer": "rerank/transfer.py",
    "decode.train_pocket": "decode/train_pocket/__main__.py",
    "decode.train_pocket.eagle3": "recipes/pocket/eagle3.py",
    "decode.train_pocket.block": "recipes/pocket/block.py",
    "decode.train_pocket.dspark": "decode/train_pocket/dspark.py",
    "decode.train_pocket.domino": "decode/train_pocket/domino.py",
    "decode.train_head": "decode/train_head.py",
}


def _sections_read(path: Path) -> set[str]:
    """The `cfg.<section>` attributes a module's `main(cfg)` and helpers take."""
    tree = ast.parse(path.read_text())
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "cfg"
    }


@pytest.mark.parametrize("stage", sorted(READS))
def test_each_command_declares_exactly_the_sections_its_main_reads(stage: str) -> None:
    assert set(READS[stage]) <= KNOWN, f"{stage}: sections the schema lacks"
    read = _sections_read(ROOT / MAINS[stage]) - set(EVERY_COMMAND)
    assert read == set(READS[stage]), stage


def test_renamed_commands_are_declared_under_their_new_names() -> None:
    import importlib.util

    from specrank.settings.renames import NEW_NAMES

    assert set(MAINS) == set(READS)
    assert not set(NEW_NAMES) & set(READS), (
        "old names are aliases (specrank.settings.renames), not stages"
    )
    for new in NEW_NAMES.values():
        spec = importlib.util.find_spec(new)
        if spec.submodule_search_locations:  # a package: `python -m` runs its __main__
            spec = importlib.util.find_spec(f"{new}.__main__")
        source = Path(spec.origin).read_text()
        # a Hydra stage is declared under its new name; the others are plain commands
        assert (new in READS) == ("run_entry_point(" in source), new
        if new in READS:
            assert f'stage="{new}"' in source, new


def test_every_section_is_read_by_some_command() -> None:
    read = {s for sections in READS.values() for s in sections} | set(EVERY_COMMAND)
    assert read >= KNOWN, f"sections no command reads: {sorted(KNOWN - read)}"


def test_another_stages_section_is_refused_naming_the_command() -> None:
    msg = stage_override_message("rerank.train", ["select.budget=8"], KNOWN)
    assert "python -m rerank.train does not read the 'select' section" in msg
    assert "python -m decode.record" in msg and "python -m decode.run" in msg
    assert "mlflow, parallel, paths, rerank, seed" in msg  # what it does read
    # group choices fill sections too; global packages and hydra.* go everywhere
    assert "'data' section" in stage_override_message("rerank.train", ["data=paper"], KNOWN)
    assert "'rerank' section" in stage_override_message("decode.record", ["booster=hgb"], KNOWN)
    fine = [
        "debug=default",
        "experiment=paper",
        "hydra.run.dir=x",
        "seed=3",
        "paths.traces=t",
        "-m",
    ]
    assert stage_override_message("rerank.train", [*fine, "rerank.n_resamples=5"], KNOWN) is None


def test_a_setting_the_command_ignores_points_at_the_one_it_reads() -> None:
    msg = stage_override_message("decode.run", ["select.rule=root"], KNOWN)
    assert "does not read 'select.rule'" in msg and "Did you mean 'run.rule'?" in msg
    assert stage_override_message("decode.record", ["select.rule=draft"], KNOWN) is None


def test_did_you_mean_is_over_the_commands_sections() -> None:
    top = {*READS["rerank.train"], *EVERY_COMMAND}
    msg = unknown_key_message(["rerankk.n_resamples=5"], schema(), top)
    assert "Did you mean 'rerank'?" in msg and "select" not in msg


def test_make_run_routes_each_override_to_the_stages_that_read_it() -> None:
    args = ["debug=default", "rerank.n_resamples=5", "features.traces=t", "pool.top_k=4"]
    assert route("features.extract", args, KNOWN) == (
        ["debug=default", "features.traces=t"],
        ["rerank.n_resamples=5", "pool.top_k=4"],
    )
    kept, dropped = route("decode.run", ["select.rule=root", "select.budget=8"], KNOWN)
    assert (kept, dropped) == (["select.budget=8"], ["select.rule=root"])
    # a typo is no other stage's: kept, so the stage refuses it with its suggestions
    assert route("rerank.train", ["rerank.n_resampels=5"], KNOWN)[0] == ["rerank.n_resampels=5"]


def test_the_command_line_refuses_and_routes() -> None:
    cmd = [sys.executable, "-m", "features.extract", "rerank.n_resamples=5", "--cfg", "job"]
    env = {k: v for k, v in os.environ.items() if k != ROUTED_ENV}
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "python -m features.extract does not read the 'rerank' section" in refused.stderr
    routed = subprocess.run(
        cmd, cwd=ROOT, env={**env, ROUTED_ENV: "1"}, capture_output=True, text=True, timeout=120
    )
    assert routed.returncode == 0, routed.stderr
    assert "for the other stages: rerank.n_resamples=5" in routed.stderr
    assert "features:" in routed.stdout  # the job's config, printed by --cfg job


def test_a_command_runs_with_the_imports_objects_frozen_out_of_the_collector(monkeypatch) -> None:
    import gc

    from specrank.settings.cli import run_entry_point

    seen = []
    monkeypatch.setattr(sys, "argv", ["rerank.train"])
    try:
        run_entry_point(lambda: seen.append(gc.get_freeze_count()), stage="rerank.train")
    finally:
        gc.unfreeze()
    assert seen and seen[0] > 0
