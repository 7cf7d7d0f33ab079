"""`python -m decode.train_head`: train an EAGLE-3 head for the target of `model=...` and
write it into `model.drafter` (`recipes.eagle3`; settings `head.*`, conf/train_head.yaml).

    python -m decode.train_head model=smollm2     # about an hour of CPU; rerun resumes
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

import specrank.settings.config  # noqa: F401  (registers the root schema)
from recipes.eagle3.recipe import run
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR

log = logging.getLogger("recipes.eagle3")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train_head")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    run(OmegaConf.to_object(cfg.head), OmegaConf.to_object(cfg.model), log.info)


if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_head")
