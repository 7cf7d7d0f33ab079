"""Position limits: every prompt checked against the models before the first decode.

A run needs `prompt + decode.max_new_tokens + depth` positions (the last round may
overshoot the token limit by the tree depth). The target's `max_position_embeddings`
and a standalone drafter's are hard limits: past them a run is refused. An EAGLE-3
head's configured length is its *training* length (most released heads carry
EAGLE's training-config 2048): its rotary positions are computed for any position,
so past it the head decodes on, with a warning, up to the target's limit, as EAGLE's
own code does. `model.strict_head_positions=true` makes it a hard limit again.

`check_prompt_lengths` reads only config.json files and the tokenizer (no weights):
`decode.record` and `decode.run` call it before any model loads, so a suite with one
long prompt is refused at once, listing the prompts and their lengths, or, with
`data.long_prompts=skip`, decoded without them (the count is logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from transformers import AutoConfig, AutoTokenizer

from pairs.config import ModelConfig
from pairs.models import checkpoint_dir, drafter_kind
from pairs.prompts import Prompt, encode_prompt
from specrank.settings.checks import check_choice
from tree.config import PoolConfig
from tree.pool import level_sizes

log = logging.getLogger(__name__)
LONG_PROMPTS = ("refuse", "skip")  # data.long_prompts


def needed_positions(n_prompt: int, max_new_tokens: int, pool: PoolConfig) -> int:
    """Positions a prompt's run may reach: prompt + max_new_tokens + the tree depth."""
    return n_prompt + max_new_tokens + len(level_sizes(pool))


@dataclass(frozen=True)
class PositionLimits:
    """`max_position_embeddings` per model setting: hard (refused past) and soft (warned past)."""

    hard: dict[str, int] = field(default_factory=dict)
    soft: dict[str, int] = field(default_factory=dict)

    @property
    def hard_limit(self) -> tuple[str, int] | None:
        """The smallest hard limit and its setting (None: no model states one)."""
        return min(self.hard.items(), key=lambda kv: kv[1]) if self.hard else None

    def check(self, n_prompt: int, need: int, max_new_tokens: int, depth: int) -> list[str]:
        """Refuse a run past a hard limit; return the warnings past the soft ones."""
        for name, limit in self.hard.items():
            if need > limit:
                raise ValueError(
                    f"{name}: a {n_prompt}-token prompt + decode.max_new_tokens="
                    f"{max_new_tokens} + depth {depth} needs {need} positions, "
                    f"but the model has max_position_embeddings={limit}"
                )
        return [
            f"{name}: {need} positions pass the EAGLE-3 head's configured "
            f"max_position_embeddings={limit} (its training length); decoding on up to the "
            f"target's limit (model.strict_head_positions=true refuses instead)"
            for name, limit in self.soft.items()
            if need > limit
        ]


def _limit(config, setting: str) -> int:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:  # nothing to check against: refuse rather than run past the range
        raise ValueError(
            f"{setting}: its config has no max_position_embeddings, so a run cannot be "
            f"checked against its trained range"
        )
    return int(limit)


def limits_of(target_config, drafter_config, eagle3: bool, strict_head: bool) -> PositionLimits:
    """The limits of a pair from its configs (an EAGLE-3 head's is soft unless strict)."""
    hard = {"model.target": _limit(target_config, "model.target")}
    drafter = _limit(drafter_config, "model.drafter")
    if eagle3 and not strict_head:
        return PositionLimits(hard, {"model.drafter": drafter})
    return PositionLimits(hard | {"model.drafter": drafter})


def read_limits(model: ModelConfig) -> PositionLimits:
    """The pair's limits from its config.json files alone (no weights are read)."""
    kind = drafter_kind(model)
    local = {"local_files_only": True, "trust_remote_code": model.trust_remote_code}
    target_dir = checkpoint_dir(model.target, "model.target", model.fetch)
    target = AutoConfig.from_pretrained(target_dir, **local)
    drafter = kind.read_config(checkpoint_dir(model.drafter, "model.drafter"), model)
    return limits_of(target, drafter, kind.head, model.strict_head_positions)


def check_prompt_lengths(
    model: ModelConfig,
    prompts: list[Prompt],
    max_new_tokens: int,
    pool: PoolConfig,
    long_prompts: str,
) -> list[Prompt]:
    """The prompts to decode: all of them, or refused / skipped (`long_prompts`) past a limit.

    Every prompt is tokenized as the decoder will (`encode_prompt`) and checked against
    the hard limits; past an EAGLE-3 head's soft limit one warning gives the count.
    """
    check_choice("data.long_prompts", long_prompts, LONG_PROMPTS)
    kind = drafter_kind(model)
    if kind.check_pool is not None:  # the pool against the drafter's config, before loading
        kind.check_pool(checkpoint_dir(model.drafter, "model.drafter"), model, pool)
    limits = read_limits(model)
    tokenizer = AutoTokenizer.from_pretrained(
        checkpoint_dir(model.target, "model.target", model.fetch),
        local_files_only=True,
        trust_remote_code=model.trust_remote_code,
    )
    depth = len(level_sizes(pool))
    lengths = [len(encode_prompt(tokenizer, p.text)) for p in prompts]
    need = [n + max_new_tokens + depth for n in lengths]
    setting, limit = limits.hard_limit or ("", None)
    too_long = [i for i, n in enumerate(need) if limit is not None and n > limit]
    if too_long and long_prompts == "refuse":
        shown = ", ".join(f"{prompts[i].id} ({lengths[i]} tokens)" for i in too_long[:10])
        raise ValueError(
            f"data: {len(too_long)} of {len(prompts)} prompts are too long for {setting} "
            f"(max_position_embeddings={limit}; a prompt needs its tokens + "
            f"decode.max_new_tokens={max_new_tokens} + depth {depth}): {shown}"
            f"{', ...' if len(too_long) > 10 else ''}. Set data.long_prompts=skip to decode "
            f"the others"
        )
    if too_long:
        log.warning("data.long_prompts=skip: %d of %d prompts skipped, too long for %s "
                    "(max_position_embeddings=%d)", len(too_long), len(prompts), setting,
                    limit)  # fmt: skip
    skip = set(too_long)
    kept = [p for i, p in enumerate(prompts) if i not in skip]
    if not kept:
        raise ValueError(f"data: every one of the {len(prompts)} prompts is too long for "
                         f"{setting} (max_position_embeddings={limit})")  # fmt: skip
    for name, soft in limits.soft.items():
        past = sum(need[i] > soft for i in range(len(prompts)) if i not in skip)
        if past:
            log.warning(
                "%s: %d prompt(s) pass the EAGLE-3 head's configured max_position_embeddings="
                "%d (its training length); they decode on up to the target's limit "
                "(model.strict_head_positions=true refuses them)", name, past, soft,
            )  # fmt: skip
    return kept
