"""`python -m decode.train_head`: train the drafter `model.drafter_kind` names for the target of
`model=...` and write it into `model.drafter`: eagle3 by the EAGLE-3 head recipe
(`recipes.eagle3`, settings `head.*`), block / dspark / domino by the block-family recipe on
the same capture (`recipes.block_head`, settings `block_head.*`); conf/train_head.yaml.

    python -m decode.train_head model=smollm2          # the EAGLE-3 head; a rerun resumes
    python -m decode.train_head model=smollm2_block    # DFlash block drafter, same capture
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig, OmegaConf

import specrank.settings.config  # noqa: F401  (registers the root schema)
from recipes.block_head.recipe import run as run_block_family
from recipes.eagle3.recipe import run
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR

log = logging.getLogger("recipes.eagle3")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train_head")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    head, model = OmegaConf.to_object(cfg.head), OmegaConf.to_object(cfg.model)
    if model.drafter_kind == "eagle3":
        run(head, model, log.info)
    else:
        run_block_family(head, OmegaConf.to_object(cfg.block_head), model, log.info)


if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_head")
