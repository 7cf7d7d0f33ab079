"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

import specrank.config  # noqa: F401  (registers the Hydra schema)

CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture()
def hydra_conf():
    """Hydra initialised on the project's conf/ for `compose`, cleared afterwards."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield
    GlobalHydra.instance().clear()
