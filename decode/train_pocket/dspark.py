"""`python -m decode.train_pocket.dspark`: train, calibrate and ship the pocket DSpark drafter, its
held-out tau in its card (`recipes.pocket.dspark`, `decode.train_pocket.semiar`)."""

import hydra
from omegaconf import DictConfig, OmegaConf

from decode.train_pocket.semiar import train_and_measure
from specrank.settings.cli import exits_on_refusal, run_entry_point
from specrank.settings.paths import CONF_DIR


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="pocket")
@exits_on_refusal
def main(cfg: DictConfig) -> None:
    train_and_measure("dspark", OmegaConf.to_object(cfg.pocket_dspark))


if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_pocket.dspark")
