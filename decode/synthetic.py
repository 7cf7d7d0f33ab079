"""Synthetic traces from a known toy target and drafter (tests and benchmarks).

(Being written: see the synthetic-traces work item.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SynthConfig:
    """Toy target/drafter behind synthetic traces."""

    vocab: int = 64  # toy vocabulary size
    target_sharpness: float = 3.0  # scale of the target's logits (higher = more peaked rows)
    draft_temperature: float = 1.3  # drafter logits = target logits / this + noise
    draft_noise: float = 1.0  # std of the drafter's logit noise
    retained_noise: float = 0.6  # std of noise between a retained row and the next root row
    p_cache: float = 0.85  # share of rounds with a token-keyed cache row
    p_same: float = 0.6  # share of rounds with a same-token row
