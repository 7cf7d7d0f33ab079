"""`python -m decode.train_pocket.dspark` and `.domino`: train and ship the pocket semi-AR drafters
(`recipes.pocket.dspark`, `recipes.pocket.domino`), then decode held-out prompts with each
for its card's tau.

The held-out tau is decoding's own (the recipes do not decode): greedy (T=0), the draft rule
at B=8 (7 drafted nodes of the default 710-candidate pool, as `bench.bench_drafters`' tree at
B=8), on the default suite's first `card_prompts` prompts taken from its sources in turn
(HumanEval and held-out ShareGPT, never trained on), the pocket block drafter (DFlash's
recipe, `models/pocket/block`) beside it on the same prompts. tau: tokens a round emits, the
bonus token included, over every round of every prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from omegaconf import OmegaConf

import specrank.settings.config  # noqa: F401  (registers the root schema)
from decode.baseline import autoregressive_decode
from decode.loop import decode_prompt
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from pairs.config import DataConfig, ModelConfig
from pairs.models import load_model_pair
from pairs.prompts import Prompt, encode_prompt, load_prompts
from recipes.pocket import domino, dspark
from recipes.pocket.config import PocketSemiARConfig
from specrank.settings.paths import CONF_DIR, project_path
from tree.config import DecodeConfig, PoolConfig, SelectConfig

log = logging.getLogger("decode.train_pocket.semiar")
BLOCK = "models/pocket/block"  # the DFlash-recipe block drafter, measured beside
BUDGET = 8  # the paper's B: verified tokens, the root included


def heldout_prompts(n: int) -> list[Prompt]:
    """The default suite's first `n` prompts, taken from its sources in turn."""
    suite = OmegaConf.load(CONF_DIR / "data/default.yaml")
    data = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), suite))
    sources = [dataclasses.replace(s, path=None if s.path is None else str(project_path(s.path)))
               for s in data.sources]  # fmt: skip
    per = [load_prompts(dataclasses.replace(data, sources=[s])) for s in sources]
    k = -(-n // len(per))
    return [p for ps in per for p in ps[:k]][:n]


def _tau(kind: str, target: str, drafter: Path, prompts: list[Prompt], tokens: int) -> dict:
    cfg = ModelConfig(name=f"pocket_{kind}", target=str(project_path(target)),
                      drafter=str(drafter), drafter_kind=kind)  # fmt: skip
    pair = load_model_pair(cfg)
    dec = DecodeConfig(temperature=0.0, max_new_tokens=tokens)
    s = OnlineSettings(DecodeSettings(PoolConfig(), SelectConfig(budget=BUDGET - 1), dec))
    emitted = rounds = 0
    lossless = True
    for p in prompts:
        ids = encode_prompt(pair.tokenizer, p.text)
        with torch.no_grad():
            res = decode_prompt(pair.target, pair.drafter, ids, s, pair.eos_ids, p.id, p.task)
            plain = autoregressive_decode(pair.target, ids, len(res.output))
        lossless &= res.output == plain
        emitted += sum(len(r.emitted) for r in res.rounds)
        rounds += len(res.rounds)
    return {"tau": emitted / max(rounds, 1), "rounds": rounds, "lossless": lossless}


def heldout_tau(pc: PocketSemiARConfig, kind: str, folder: Path) -> dict:
    """The card's held-out tau of the drafter at `folder`, and the block drafter's beside it."""
    prompts = heldout_prompts(pc.card_prompts)
    own = _tau(kind, pc.target, folder, prompts, pc.card_tokens)
    block = _tau("block", pc.target, project_path(BLOCK), prompts, pc.card_tokens)
    log.info(f"held-out tau at B={BUDGET}, T=0: {kind} {own['tau']:.3f}, block {block['tau']:.3f}")
    return {"prompts": len(prompts), "max_new_tokens": pc.card_tokens, "budget": BUDGET,
            **own, "block_tau": block["tau"], "block_rounds": block["rounds"],
            "lossless": own["lossless"] and block["lossless"]}  # fmt: skip


def train_and_measure(kind: str, pc: PocketSemiARConfig) -> dict:
    """The kind's recipe, its held-out tau measured before the card is written (none with
    `card_prompts` 0)."""
    measure = (lambda out: heldout_tau(pc, kind, out)) if pc.card_prompts > 0 else None
    recipe = {"dspark": dspark.run, "domino": domino.run}[kind]
    return recipe(pc, log.info, measure)
