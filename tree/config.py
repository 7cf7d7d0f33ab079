"""Typed settings of one round's tree: pool growth, selection, verification (`pool:`,
`select:` and `decode:` sections; see `specrank.settings.config`).

Plain dataclasses: Hydra schemas, and the typed values library functions receive.
"""

from __future__ import annotations

from dataclasses import dataclass

from specrank.settings.fields import setting


@dataclass
class PoolConfig:
    """Pool growth (docs/method.md#pool). Defaults give 10 + 7 * 100 = 710 candidates, 70 expanded."""

    top_k: int = setting(10, "children proposed per expanded node (and at the root)")
    expand_steps: int = setting(
        7, "expansion steps after the first level: candidates at depths 2 .. expand_steps + 1"
    )
    expand: int = setting(10, "nodes expanded per step (highest cumulative draft log-prob)")


@dataclass
class SelectConfig:
    """Which verified tree a round keeps and what else its pass scores (docs/method.md#scored-set)."""

    rule: str = setting("draft", "selection rule of the verified tree (selection/rules.py)")
    budget: int = setting(59, "B: non-root nodes of the verified tree")
    record_top_m: int = setting(
        160,
        "the M highest-ranked draft candidates a recording pass scores beside the tree and the "
        "expanded nodes (0: tree + expanded only); formerly select.top_m",
    )


@dataclass
class DecodeConfig:
    temperature: float = setting(
        0.0, "0: greedy; > 0: exhaustive target sampling at this temperature"
    )
    # exhaustive | eagle3 (child-by-child; same law) | coupling (a chain drawn at
    # draft_temperature > 0: accept with min(1, p/q), else draw from (p - q)+; same law)
    verifier: str = setting("exhaustive", "exhaustive | eagle3 | coupling: the same output law")
    # Stop after the round in which the output reaches this many tokens (or emits EOS).
    # A round emits up to depth + 1 = 9 tokens, so outputs hold at most 256 + 8 = 264
    # tokens: the paper's "at most 264" (and 1,024 -> "at most 1,032") implies 256 here.
    max_new_tokens: int = setting(256, "stop after the round whose output reaches this many tokens")
    seed: int = setting(0, "per-prompt generators are seeded from (seed, prompt id)")
    # The drafter's temperature T_d (the pair T_t|T_d: decode.temperature|this). null: today's
    # drafting (deterministic top-k children, scored at unit temperature). 0: the same drafts,
    # labelled T_d = 0 (the paper's 0|0 and 1|0). > 0: the drafter's scores tempered and each
    # expanded node's top_k children drawn without replacement from them (the paper's 1|1;
    # a chain, top_k = 1, draws one token a position), from a per-prompt draft generator.
    draft_temperature: float | None = setting(
        None, "the drafter's temperature T_d (null: deterministic top-k children)"
    )


SECTIONS = {"pool": PoolConfig, "select": SelectConfig, "decode": DecodeConfig}
