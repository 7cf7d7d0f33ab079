"""Typed settings of synthetic traces (`synth:` the toy models, `synth_job:` the job)."""

from __future__ import annotations

from dataclasses import dataclass

from specrank.settings.fields import setting


@dataclass
class SynthConfig:
    """Toy target/drafter behind synthetic traces: every address has its own i.i.d. logits z;
    the target row is softmax(target_sharpness * z / T), the drafter's a tempered, noisy copy."""

    vocab: int = setting(64, "toy vocabulary size (at least pool.top_k and 2)")
    target_sharpness: float = setting(
        3.0, "scale of the target's logits: higher gives more peaked target rows"
    )
    draft_temperature: float = setting(
        1.3, "the drafter's logits are the target's divided by this, plus noise"
    )
    draft_noise: float = setting(1.0, "standard deviation of the drafter's logit noise")
    retained_noise: float = setting(
        0.6,
        "standard deviation of the logit noise between a cache, same-token or preceding row "
        "and the next root row",
    )
    matched_noise: float = setting(
        0.01,
        "logit noise of the matched row: batch rounding only, so its total variation to the "
        "root row stays well under 0.01",
    )
    token_only_noise: float = setting(
        1.5, "logit noise of the token-only rows (total variation about 0.4, as in the paper)"
    )
    p_cache: float = setting(
        0.85,
        "probability, in [0, 1], that a token occurs in a toy prompt, so the token-keyed cache "
        "holds its row from prefill before any round stores one",
    )
    prompt_length_min: int = setting(
        16, "shortest toy prompt length (tokens): lengths are drawn uniformly in [min, max]"
    )
    prompt_length_max: int = setting(512, "longest toy prompt length (tokens)")


@dataclass
class SynthJobConfig:
    """`python -m decode.synth_traces`: how many synthetic prompts and rounds to write.

    Shard s runs at temperatures[s % len]; paper scale (365,922 rounds) is
    `synth_job.toy_prompts=1402 synth_job.rounds_per_prompt=261`.
    """

    toy_prompts: int = setting(
        64, "toy prompts written (paper scale: 1402); formerly synth_job.prompts"
    )
    rounds_per_prompt: int = setting(40, "rounds decoded per prompt (paper scale: 261)")
    prompts_per_shard: int = setting(
        16, "consecutive prompts per shard: the unit a rerun resumes from"
    )
    temperatures: list[float] = setting(
        [0.0, 1.0], "the laws written: shard s is decoded at temperatures[s % len]"
    )
    tasks: list[str] = setting(
        ["mt_bench", "coding", "math_reasoning", "qa"],
        "task labels (docs/method.md#reporting); prompt i has task tasks[(i // 2) % len], so "
        "both halves of an even/odd split hold every task",
    )


SECTIONS = {"synth": SynthConfig, "synth_job": SynthJobConfig}  # see specrank.settings.config
