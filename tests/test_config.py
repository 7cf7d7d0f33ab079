"""Every primary config and every config-group option composes against the schema."""

from __future__ import annotations

import pytest
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import specrank.config  # noqa: F401  (registers the schema)
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
