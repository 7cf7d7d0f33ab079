"""Every primary config and every config-group option composes against the schema."""

from __future__ import annotations

import pytest
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import specrank.settings.config  # noqa: F401  (registers the schema)
from tests.conftest import CONF

PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "run_dirs")
GROUPS = sorted((d.name, p.stem) for d in CONF.iterdir() if d.is_dir() for p in d.glob("*.yaml"))


@pytest.mark.parametrize("primary", PRIMARY)
@pytest.mark.parametrize("debug", [False, True])
def test_primary_configs_compose(hydra_conf, primary, debug):
    cfg = compose(primary, overrides=["debug=default"] if debug else [])
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.seed is not None


@pytest.mark.parametrize(("group", "option"), [g for g in GROUPS if g[0] != "debug"])
def test_every_group_option_composes(hydra_conf, group, option):
    users = [p for p in PRIMARY if f"- {group}:" in (CONF / f"{p}.yaml").read_text()]
    assert users, f"config group '{group}' is used by no primary config in conf/"
    cfg = compose(users[0], overrides=[f"{group}={option}"], return_hydra_config=True)
    assert cfg.hydra.runtime.choices[group] == option


def test_typo_fails_at_compose_time(hydra_conf):
    with pytest.raises(Exception, match="budgte"):
        compose(PRIMARY[0], overrides=["select.budgte=8"])


def test_wrong_type_fails_at_compose_time(hydra_conf):
    with pytest.raises(Exception, match="budget"):
        compose(PRIMARY[0], overrides=["select.budget=many"])


def test_run_dirs_never_collide(hydra_conf):
    dirs = set()
    for _ in range(5):
        cfg = compose(PRIMARY[0], return_hydra_config=True)
        # the job name is set by @hydra.main at run time; stand in for it here
        cfg.hydra.job.name = "job"
        HydraConfig.instance().set_config(cfg)
        dirs.add(OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"])
    assert len(dirs) == 5
    assert all(d.startswith("outputs/") for d in dirs)


# The paper's settings, from SPEC §2-9 (not from conf/): what experiment=paper must compose to.
PAPER = {
    "pool.top_k": 10,
    "pool.expand_steps": 7,
    "pool.expand": 10,
    "select.rule": "draft",
    "select.budget": 59,
    "select.record_top_m": 160,
    "rerank.booster.kind": "hgb",
    "rerank.booster.n_iter": 400,  # fixed: no early stopping
    "rerank.booster.learning_rate": 0.05,
    "rerank.booster.max_leaves": 63,
    "rerank.booster.early_stopping": False,
    "rerank.halves": "even_odd",
    "rerank.prior_split": "row",  # SPEC §7: "split candidates in alternation"
    "rerank.budgets": [8, 59],
    "rerank.feature_sets": ["base", "rows"],
    "rerank.calibrators": ["iso_q1", "per_depth"],
    "rerank.substitutions": ["cache", "same", "prev"],
    "rerank.mixture_weights": [0.25, 0.5, 0.75],
    "rerank.n_resamples": 2000,
    "rerank.draft_top_m": 0,
}


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], node


def test_experiment_paper_is_the_papers_settings(hydra_conf):
    cfg = OmegaConf.to_container(compose("train", overrides=["experiment=paper"]))
    got = dict(_leaves(cfg))
    assert {k: got[k] for k in PAPER} == PAPER


def test_experiment_paper_states_only_deltas(hydra_conf):
    paper = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / "paper.yaml"))
    default = dict(_leaves(OmegaConf.to_container(compose("train"))))
    same = [k for k, v in _leaves(paper) if k != "defaults" and default.get(k) == v]
    assert not same, f"conf/experiment/paper.yaml repeats defaults: {same}"


def test_the_default_reranker_is_lightgbm_beside_the_papers_hgb(hydra_conf):
    from rerank.config import BoosterConfig

    # the job's default (conf/train.yaml) and the typed settings' default agree
    assert compose("train").rerank.booster.kind == BoosterConfig().kind == "lgbm"
    assert compose("train", overrides=["booster=hgb"]).rerank.booster.kind == "hgb"


def test_a_typo_gets_the_closest_valid_keys():
    from specrank.settings.cli import unknown_key_message
    from specrank.settings.config import schema

    s = schema()
    msg = unknown_key_message(["select.budge=8"], s)
    assert (
        msg.startswith("Key 'budge' is not in 'select'") and "Did you mean 'select.budget'" in msg
    )
    assert "'rerank.booster.kind'" in unknown_key_message(["rerank.booster.knd=lgbm"], s)
    for fine in (["select.budget=8"], ["model=pocket"], ["model.target=/x"], ["+a.b=1"]):
        assert unknown_key_message(fine, s) is None, fine


def test_entry_points_refuse_a_typo_before_hydra_runs():
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "rerank.train", "rerank.budgest=[8]"],
        capture_output=True, text=True, timeout=120, cwd=CONF.parent,
    )  # fmt: skip
    assert res.returncode == 2  # a refusal (specrank.settings.errors): a message, no trace
    assert "error: Key 'budgest' is not in 'rerank'" in res.stderr
    assert "Did you mean 'rerank.budgets'" in res.stderr and "Traceback" not in res.stderr
