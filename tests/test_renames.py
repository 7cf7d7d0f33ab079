"""Renamed settings: an old name on the command line answers with the new one; a store written
under an old name still opens; a logged run's parameters show under the new names; a saved
reranker or head recipe written before a rename still reads."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from specrank.settings.cli import checked_argv
from specrank.settings.errors import Refusal
from specrank.settings.renames import RENAMED, migrated_config, migrated_params, new_name
from specrank.store.tables import SchemaError
from specrank.store.trace_schema import trace_store

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = sorted((old, new) for old, new in RENAMED.items() if "." in old)
GROUPS = sorted((old, new) for old, new in RENAMED.items() if "." not in old)


@pytest.mark.parametrize(("old", "new"), SETTINGS)
def test_an_old_name_is_refused_with_the_new_one(old, new):
    with pytest.raises(Refusal, match=rf"'{old}' was renamed .*Did you mean '{new}'\?"):
        checked_argv([f"{old}=5"], {}, None)
    assert checked_argv([f"{new}=5"], {}, None) == [f"{new}=5"]


@pytest.mark.parametrize(
    ("arg", "new"),
    [
        ("rerank.model.kind=hgb", "rerank.booster.kind"),
        ("rerank.model.fit_nodes=2", "rerank.booster.fit_nodes"),
        ("+rerank.model.n_threads=1", "rerank.booster.n_threads"),
        ("head.data.chunk=128", "head.corpus.chunk"),
        ("head.data.top_k=8", "head.corpus.target_top_k"),  # its own entry wins
    ],
)
def test_every_setting_under_a_renamed_section_answers_with_its_new_name(arg, new):
    old = arg.partition("=")[0].lstrip("+")
    with pytest.raises(Refusal, match=rf"'{old}' was renamed .*Did you mean '{new}'\?"):
        checked_argv([arg], {}, "rerank.train" if "rerank" in arg else None)
    assert checked_argv([f"{new}=1"], {}, None) == [f"{new}=1"]


@pytest.mark.parametrize(("old", "new"), GROUPS)
@pytest.mark.parametrize("choice", ["lgbm", "hgb,lgbm"])
def test_an_old_config_group_is_refused_with_the_new_override(old, new, choice):
    with pytest.raises(
        Refusal, match=rf"group '{old}' was renamed .*Did you mean '{new}={choice}'"
    ):
        checked_argv([f"{old}={choice}"], {}, "rerank.train")
    assert checked_argv([f"{new}={choice}"], {}, "rerank.train") == [f"{new}={choice}"]


def test_the_entry_point_refuses_the_old_group_before_hydra_runs():
    done = subprocess.run([sys.executable, "-m", "rerank.train", "rerank_model=hgb"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "Did you mean 'booster=hgb'?" in done.stderr


def test_names_that_only_start_like_an_old_one_are_left_alone():
    for name in ("data.chunked", "rerank.models", "rerank.booster.kind", "head.data_x", "model"):
        assert new_name(name) is None, name


def test_a_store_written_under_an_old_name_opens_under_the_new_one(tmp_path):
    old = {"select": {"budget": 8, "top_m": 64}, "run": {"top_m": 100, "rule": "draft"}}
    store = trace_store(tmp_path / "traces")
    store.open_for_writing(old, {"target": "t"})
    new = {"select": {"budget": 8, "record_top_m": 64},
           "run": {"score_top_m": 100, "rule": "draft"}}  # fmt: skip
    assert migrated_config(old) == new
    trace_store(tmp_path / "traces").open_for_writing(new, {"target": "t"})
    other = {**new, "select": {"budget": 8, "record_top_m": 32}}
    with pytest.raises(SchemaError, match=r"select\.record_top_m"):
        trace_store(tmp_path / "traces").open_for_writing(other, {"target": "t"})


def test_a_synthetic_store_written_before_toy_prompts_opens(tmp_path):
    from recipes.synth.config import SynthJobConfig

    new = {"seed": 0, "synth_job": dataclasses.asdict(SynthJobConfig(toy_prompts=8))}
    old = {"seed": 0, "synth_job": {("prompts" if k == "toy_prompts" else k): v
                                    for k, v in new["synth_job"].items()}}  # fmt: skip
    trace_store(tmp_path / "synth").open_for_writing(old, {"target": "synthetic"})
    trace_store(tmp_path / "synth").open_for_writing(new, {"target": "synthetic"})


def test_nested_sections_move_whole_and_new_names_stay():
    old = {"rerank": {"model": {"kind": "hgb", "n_iter": 400}, "workers": 3, "budgets": [8]},
           "head": {"seed": 1, "data": {"top_k": 32, "chunk": 384}},
           "synth_job": {"prompts": 8}}  # fmt: skip
    new = {"rerank": {"booster": {"kind": "hgb", "n_iter": 400}, "eval_threads": 3,
                      "budgets": [8]},
           "head": {"seed": 1, "corpus": {"target_top_k": 32, "chunk": 384}},
           "synth_job": {"toy_prompts": 8}}  # fmt: skip
    assert migrated_config(old) == new
    assert migrated_config(new) == new
    assert old["rerank"]["model"] == {"kind": "hgb", "n_iter": 400}  # the input is not changed


def test_logged_parameters_show_under_the_new_names():
    params = {"rerank.top_m": "0", "rerank.score_top_m": "100", "seed": "0",
              "rerank.model.kind": "hgb", "rerank.model.n_iter": "400", "rerank.workers": "3"}  # fmt: skip
    assert migrated_params(params) == {
        "rerank.draft_top_m": "0", "rerank.score_top_m": "100", "seed": "0",
        "rerank.booster.kind": "hgb", "rerank.booster.n_iter": "400", "rerank.eval_threads": "3",
    }  # fmt: skip


def test_a_run_logged_before_the_rename_lines_up_with_one_after(monkeypatch):
    """`differing_params` (the notebook's table) shows old and new runs' settings in one row."""
    from rerank.report import runs as R

    logged = {"old": {"rerank.model.kind": "hgb", "rerank.model.n_iter": "400"},
              "new": {"rerank.booster.kind": "lgbm", "rerank.booster.n_iter": "400"}}  # fmt: skip
    fake = SimpleNamespace(
        get_run=lambda rid: SimpleNamespace(data=SimpleNamespace(params=logged[rid]))
    )
    monkeypatch.setattr(R, "client", lambda uri: fake)
    runs = pd.DataFrame({"run": ["before", "after"], "run_id": ["old", "new"]})
    differ = R.differing_params(runs, "unused")
    assert list(differ.index) == ["rerank.booster.kind"]
    assert list(differ.loc["rerank.booster.kind"]) == ["hgb", "lgbm"]


def test_a_saved_reranker_names_no_section():
    """A sidecar records the boosting capacity under the settings' own names (`vars` of
    `Capacity`), never `rerank.model`: renaming the section leaves saved rerankers as they are."""
    from rerank.config import BoosterConfig
    from rerank.fit.boosting import Capacity
    from rerank.settings import model_capacity

    capacity = vars(model_capacity(BoosterConfig()))
    assert set(capacity) == {f.name for f in dataclasses.fields(Capacity)}
    assert set(capacity) <= {f.name for f in dataclasses.fields(BoosterConfig)}


def test_a_head_recipe_written_before_the_rename_gives_the_same_card(tmp_path):
    """`bench.bench_head --card` rewrites a shipped head's card from its recipe.json."""
    from recipes.eagle3.card import write_card

    shipped = ROOT / "models" / "smollm2" / "eagle3"
    if not (shipped / "recipe.json").is_file():
        pytest.skip("no shipped SmolLM2 head")
    facts = json.loads((shipped / "recipe.json").read_text())
    corpus = dict(facts["config"].pop("corpus"))  # as written before head.data was renamed
    facts["config"]["data"] = corpus | {"top_k": corpus.pop("target_top_k")}
    write_card(tmp_path, facts)
    assert (tmp_path / "MODEL_CARD.md").read_text() == (shipped / "MODEL_CARD.md").read_text()
    config = json.loads((tmp_path / "recipe.json").read_text())["config"]
    assert "data" not in config
    assert config["corpus"]["target_top_k"] == facts["config"]["data"]["top_k"]


def test_a_store_written_before_expand_steps_is_read_under_the_new_name(tmp_path):
    """Readers of a manifest's sections (the pool size the job evaluates at), not only the
    writer's compatibility check, see an old store under today's names."""
    from rerank.settings import store_pool_size

    old = {"pool": {"top_k": 10, "steps": 7, "expand": 10}, "select": {"budget": 8}}
    trace_store(tmp_path / "traces").open_for_writing(old, {"target": "t"})
    store = trace_store(tmp_path / "traces")
    assert store.manifest()["config"]["pool"] == {"top_k": 10, "expand_steps": 7, "expand": 10}
    assert store_pool_size(store.manifest(), store.root) == 710
