"""The resumable training loop's schedule settings (`recipes.resume.fit_resumable`), apart from
the loop so that reading the settings schema imports no model code."""

from __future__ import annotations

from dataclasses import dataclass

from specrank.settings.fields import setting


@dataclass
class HeadTrainConfig:
    """The resumable loop's schedule (`fit`): AdamW, linear warm-up, cosine to a floor."""

    steps: int = setting(1200, "optimizer steps at most")
    batch: int = setting(4, "windows per step")
    lr: float = setting(1e-3, "peak learning rate: linear warm-up, then cosine")
    warmup: int = setting(40, "warm-up steps")
    min_lr_ratio: float = setting(0.1, "the cosine's floor, as a share of lr")
    max_minutes: float = setting(25.0, "wall-time cap; the cosine follows time when it binds")
    eval_every: int = setting(100, "steps between held-out agreement figures")
    checkpoint_minutes: float = setting(2.0, "a resumable checkpoint at most this often")
