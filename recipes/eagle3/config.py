"""Typed settings of the EAGLE-3 head recipe for a real target (`head:` section).

The target and the folder the head is written to are the `model` section's (`model.target`,
`model.drafter`), so `python -m decode.train_head model=smollm2` trains the head that
`model=smollm2` decodes with; `model.drafter_kind` picks the recipe (eagle3: this one; block,
dspark, domino: `recipes.block_head`, settings `block_head.*`, on this recipe's capture).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from recipes.block_head.config import BlockHeadConfig
from recipes.schedule import HeadTrainConfig
from specrank.settings.fields import setting


@dataclass
class HeadCorpusConfig:
    """What the head trains on: training-side ShareGPT conversations rendered under the
    target's chat template, and the target's own greedy replies to training-side first turns
    (acceptance is measured on the target's own text). Held-out conversations, the held-out
    prompt file and the suites' prompts never enter (`recipes.eagle3.data`)."""

    conversation_tokens: int = setting(150_000, "tokens of ShareGPT conversations captured")
    reply_prompts: int = setting(192, "training-side first user turns the target answers")
    reply_tokens: int = setting(160, "new tokens per reply at most (greedy, T = 0)")
    reply_batch: int = setting(32, "replies generated at once (left padding)")
    max_prompt_tokens: int = setting(256, "longer first turns are not answered")
    chunk: int = setting(384, "tokens per captured window (the target's context there)")
    capture_batch: int = setting(8, "windows per target forward while capturing")
    target_top_k: int = setting(
        32,
        "target log-probs kept per position, over the draft vocabulary; formerly head.data.top_k",
    )
    val_share: float = setting(0.03, "windows held back for the agreement figures")


@dataclass
class HeadRecipeConfig:
    """One decoder layer over the target's low / mid / high states (EAGLE-3)."""

    work_dir: str = setting("outputs/head_work", "captured shards and checkpoints")
    capture: str | None = setting(
        None,
        "the capture's folder under work_dir (or a path); null: the target's (models/<name>/... "
        "-> <name>), so every drafter kind of one target trains on one capture",
    )
    seed: int = setting(0, "data order, split and initialisation")
    threads: int = setting(2, "torch intra-op threads (capture and training)")
    # float32 on CPUs without native bfloat16 arithmetic: emulated bf16 forwards are slower
    capture_dtype: str = setting("float32", "the target's dtype while capturing")
    export_dtype: str = setting("bfloat16", "float16 | bfloat16: the shipped weights")
    aux_layers: list[int] | None = setting(
        None, "target layers feeding the head; null: (2, N // 2, N - 3), low / mid / high"
    )
    draft_vocab: int = setting(8192, "the most frequent trained-on tokens (d2t / t2d)")
    intermediate: int | None = setting(None, "null: the target's intermediate size")
    heads: int | None = setting(None, "null: the target's attention heads")
    kv_heads: int | None = setting(None, "null: the target's key/value heads")
    ttt_steps: int = setting(2, "training-time test: steps trained on the head's own outputs")
    ttt_decay: float = setting(0.8, "loss weight of step k: decay ** k")
    corpus: HeadCorpusConfig = field(default_factory=HeadCorpusConfig)
    train: HeadTrainConfig = field(default_factory=HeadTrainConfig)


# `decode.train_head` reads both: `head` (the capture, and the EAGLE-3 head) and `block_head`
# (the block-family drafters trained on that capture, `recipes.block_head`)
SECTIONS = {"head": HeadRecipeConfig, "block_head": BlockHeadConfig}
