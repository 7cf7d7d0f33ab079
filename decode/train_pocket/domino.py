"""`python -m decode.train_pocket.domino`: train and ship the pocket Domino drafter, its held-out
tau in its card (`recipes.pocket.domino`, `decode.train_pocket.semiar`)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from decode.train_pocket.semiar import train_and_measure
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    train_and_measure("domino", OmegaConf.to_object(cfg.pocket_domino))


if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_pocket.domino")
