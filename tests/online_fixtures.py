"""Shared pieces of the online-decoder tests: tiny settings, prompts, and a quickly fitted reranker.

A reranker for the tests is fitted the way the pipeline fits one, only small:
record a few prompts with the tiny models (`decode.recording.record_traces`), extract
the candidate table (`features.extract.extract`), fit with a small capacity
(`rerank.models.fit_reranker`) and save it (`rerank.persist.save_reranker`).
"""

from __future__ import annotations

from pathlib import Path

from decode.recording import record_traces
from decode.settings import OnlineSettings
from decode.stream import DecodeSettings
from features.extract import extract
from features.schema import candidate_store
from pairs.models import ModelPair, load_causal_lm
from pairs.prompts import Prompt
from rerank.fit.boosting import Capacity
from rerank.fit.models import fit_reranker
from rerank.fit.persist import save_reranker
from tests.test_decode_sampling import TINY_V
from tests.tiny_models import build_tiny_pair, tiny_model_config
from tree.config import DecodeConfig, PoolConfig, SelectConfig

# 4 + 3 * 12 = 40 candidates: every rule has room to differ from draft ranking at B=6.
SMALL_POOL = PoolConfig(top_k=4, expand_steps=3, expand=3)
FAST = Capacity(n_iter=40, learning_rate=0.1, max_leaves=15)
TEXTS = [
    ("def add(a, b):\n    return", "coding"),
    ("The quick brown fox jumps", "writing"),
    ("for i in range(10):", "coding"),
    ("Once upon a time there", "writing"),
    ("import numpy as np\n", "coding"),
    ("Dear Sir or Madam,", "writing"),
    ("class Stack:\n    def", "coding"),
    ("It was a dark and stormy", "writing"),
]
PROMPTS = [Prompt(f"p{i}", task, text) for i, (text, task) in enumerate(TEXTS)]


def settings(
    rule: str = "draft",
    temperature: float = 0.0,
    budget: int = 6,
    score: str = "tree",
    record: bool = False,
    max_new_tokens: int = 24,
    verifier: str = "exhaustive",
    pool: PoolConfig = SMALL_POOL,
    top_m: int = 4,  # run.score_top_m: fewer than the pool holds, so top_m scores a part of it
) -> OnlineSettings:
    base = DecodeSettings(
        pool=pool,
        select=SelectConfig(budget=budget, record_top_m=12),
        decode=DecodeConfig(
            temperature=temperature, max_new_tokens=max_new_tokens, verifier=verifier
        ),
    )
    return OnlineSettings(base, rule, score, record, top_m)


def fitted_reranker(
    root: Path, pair: ModelPair, temperature: float, kind: str = "lgbm", feature_set: str = "rows"
) -> Path:
    """Record, extract, fit and save a small reranker for `temperature`'s law; its folder."""
    s = settings(temperature=temperature, score="record", record=True).base
    traces, features = root / "traces", root / "features"
    record_traces(traces, pair, PROMPTS, s, 4, {"test": "online"}, progress=False)
    extract(traces, features, log=lambda _: None)
    frame = candidate_store(features).read().to_pandas()
    law = "greedy" if temperature == 0 else "sampling"
    model = fit_reranker(frame, feature_set, kind, law, n_threads=1, capacity=FAST)
    return save_reranker(model, root / f"{feature_set}_{kind}_T{temperature:g}")


def tiny_vocab_models(root: Path) -> tuple:
    """The sampling-law tests' pair: a TINY_V-token vocabulary, peaked rows, a noisy drafter."""
    build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, draft_noise=0.3)
    cfg = tiny_model_config(root, "llama")
    return load_causal_lm(cfg.target, cfg, "model.target"), load_causal_lm(
        cfg.drafter, cfg, "model.drafter"
    )
