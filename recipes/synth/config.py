"""Typed settings of synthetic traces (`synth:` the toy models, `synth_job:` the job)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SynthConfig:
    """Toy target/drafter behind synthetic traces."""

    vocab: int = 64  # toy vocabulary size
    target_sharpness: float = 3.0  # scale of the target's logits (higher = more peaked rows)
    draft_temperature: float = 1.3  # drafter logits = target logits / this + noise
    draft_noise: float = 1.0  # std of the drafter's logit noise
    retained_noise: float = (
        0.6  # logit noise between a cache/same/preceding row and the next root row
    )
    matched_noise: float = 0.01  # logit noise of the matched row (batch rounding: TV << 0.01)
    token_only_noise: float = 1.5  # logit noise of token-only rows (TV ~0.4 in the paper)
    p_cache: float = (
        0.85  # chance that the root token occurs in the prompt (cache row from prefill)
    )
    prompt_length_min: int = 16
    prompt_length_max: int = 512


@dataclass
class SynthJobConfig:
    """`python -m decode.synth`: how many synthetic prompts and rounds to write.

    Shard s runs at temperatures[s % len]; paper scale (365,922 rounds) is
    `synth_job.prompts=1402 synth_job.rounds_per_prompt=261`.
    """

    prompts: int = 64
    rounds_per_prompt: int = 40
    prompts_per_shard: int = 16
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    # labels of the paper's seven tasks (docs/method.md#reporting); a toy prompt's category is its task
    tasks: list[str] = field(default_factory=lambda: ["mt_bench", "coding", "math_reasoning", "qa"])


SECTIONS = {"synth": SynthConfig, "synth_job": SynthJobConfig}  # see specrank.config
