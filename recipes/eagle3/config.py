"""Typed settings of the EAGLE-3 head recipe for a real target (`head:` section).

The target and the folder the head is written to are the `model` section's (`model.target`,
`model.drafter`), so `python -m decode.train_head model=smollm2` trains the head that
`model=smollm2` decodes with.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HeadDataConfig:
    """What the head trains on: training-side ShareGPT conversations rendered under the
    target's chat template, and the target's own greedy replies to training-side first turns
    (acceptance is measured on the target's own text). Held-out conversations, the held-out
    prompt file and the suites' prompts never enter (`recipes.eagle3.data`)."""

    conversation_tokens: int = 150_000  # tokens of ShareGPT conversations captured
    reply_prompts: int = 192  # training-side first user turns the target answers
    reply_tokens: int = 160  # new tokens per reply at most (greedy, T = 0)
    reply_batch: int = 32  # replies generated at once (left padding)
    max_prompt_tokens: int = 256  # longer first turns are skipped for replies
    chunk: int = 384  # tokens per captured window (the target's context when captured)
    capture_batch: int = 8  # windows per target forward while capturing
    top_k: int = 32  # target log-probabilities kept per position, over the draft vocabulary
    val_share: float = 0.03  # windows held back for the agreement figures


@dataclass
class HeadTrainConfig:
    steps: int = 1200
    batch: int = 4  # windows per step
    lr: float = 1e-3  # peak; linear warm-up then cosine to lr * min_lr_ratio
    warmup: int = 40
    min_lr_ratio: float = 0.1
    max_minutes: float = 25.0  # wall-time cap; the cosine follows time when it binds
    eval_every: int = 100
    checkpoint_minutes: float = 2.0  # a resumable checkpoint at most this often


@dataclass
class HeadRecipeConfig:
    """One decoder layer over the target's low / mid / high states (EAGLE-3)."""

    work_dir: str = "outputs/head_work"  # captured shards and checkpoints (git-ignored)
    seed: int = 0
    threads: int = 2  # torch intra-op threads (capture and training)
    capture_dtype: str = "float32"  # the target's dtype while capturing: the online runs'
    export_dtype: str = "bfloat16"  # float16 | bfloat16
    # null: (2, N // 2, N - 3) for an N-layer target, EAGLE-3's low / mid / high
    aux_layers: list[int] | None = None
    draft_vocab: int = 8192  # the most frequent trained-on tokens (d2t / t2d)
    intermediate: int | None = None  # null: the target's intermediate size
    heads: int | None = None  # null: the target's attention heads
    kv_heads: int | None = None  # null: the target's key/value heads
    ttt_steps: int = 2  # training-time test: the head also trains on its own outputs
    ttt_decay: float = 0.8  # loss weight of step k: decay ** k
    data: HeadDataConfig = field(default_factory=HeadDataConfig)
    train: HeadTrainConfig = field(default_factory=HeadTrainConfig)


SECTIONS = {"head": HeadRecipeConfig}
