"""Every primary config and every config-group option composes against the schema."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import specrank.config  # noqa: F401  (registers the schema)

CONF = Path(__file__).resolve().parents[1] / "conf"
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "run_dirs")
GROUPS = sorted((d.name, p.stem) for d in CONF.iterdir() if d.is_dir() for p in d.glob("*.yaml"))


@pytest.fixture()
def hydra_conf():
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()


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
