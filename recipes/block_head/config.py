"""Typed settings of the block-family recipe for a real target (`block_head:` section).

`python -m decode.train_head` trains the drafter kind `model.drafter_kind` names: eagle3 with
`recipes.eagle3` (settings `head.*`), block / dspark / domino with `recipes.block_head`
(these settings), both on the capture `head.*` describes (`head.capture`, `head.seed`,
`head.threads`, `head.export_dtype` are read by both).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.pocket.config import DominoHeadConfig, DSparkHeadConfig
from recipes.schedule import HeadTrainConfig
from specrank.settings.fields import setting


def _train() -> HeadTrainConfig:
    """About 20 minutes of one CPU thread (the step's cost: `decode.train_head`'s log)."""
    return HeadTrainConfig(steps=3000, batch=4, lr=2e-3, warmup=40, max_minutes=20.0,
                           eval_every=100, checkpoint_minutes=2.0)  # fmt: skip


@dataclass
class BlockHeadConfig(DSparkHeadConfig, DominoHeadConfig):
    """A DFlash backbone (one Qwen3 decoder layer at the target's width, `fc` over the captured
    states, the target's embedding and lm_head frozen) and, for dspark / domino, its kind's
    correction head (`recipes.block_head`)."""

    target_layer_ids: list[int] | None = setting(
        None,
        "target layers whose LEAVING states feed the drafter (output convention); null: the "
        "capture's (head.aux_layers minus 1: SmolLM2's [1, 14, 26], low / mid / high as "
        "EAGLE-3's); other ids are refused, as the capture holds no other states",
    )
    block_size: int = setting(
        8,
        "block positions (the bonus token + 7 placeholders): block and domino draft depth 7, "
        "dspark (rows from the bonus on) 8; deeper rows of a 135M target are rarely accepted "
        "and each costs an lm_head row, the step's largest cost (decode with "
        "pool.expand_steps <= 6 for depth 7)",
    )
    mask_token_id: int | None = setting(
        None,
        "the placeholders' token; null: the tokenizer's unk token (SmolLM2's <|endoftext|>, 0, "
        "which its chat text never holds; its pad token is its end-of-turn token)",
    )
    intermediate: int | None = setting(None, "null: the target's intermediate size")
    heads: int | None = setting(None, "null: the target's attention heads")
    kv_heads: int | None = setting(None, "null: the target's key/value heads")
    anchors: int = setting(16, "blocks trained per window, at random assistant positions")
    decay_gamma: float = setting(
        4.0, "row k's loss weight exp(-(k - 1) / decay_gamma), mean 1 (DFlash's decay)"
    )
    backbone_init: str | None = setting(
        None,
        "dspark | domino: a trained block drafter folder (e.g. models/smollm2/block) whose "
        "backbone starts this one (saves CPU: the heads train on a trained backbone); null: "
        "from scratch",
    )
    train: HeadTrainConfig = field(default_factory=_train)
