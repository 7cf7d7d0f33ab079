"""`python -m decode.train_pocket`: train, export and measure the pocket target/drafter pair.

Thin Hydra shell over `recipes.pocket.recipe.run`; settings in `conf/pocket.yaml`
(`pocket.*`), e.g. `python -m decode.train_pocket pocket.stages=[export,evaluate]`.
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

import specrank.settings.config  # noqa: F401  (registers the root schema)
from recipes.pocket.config import PocketConfig
from recipes.pocket.recipe import run
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR

log = logging.getLogger("recipes.pocket")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    pc = OmegaConf.to_object(cfg.pocket)
    assert isinstance(pc, PocketConfig)
    run(pc, log.info)


if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_pocket")
