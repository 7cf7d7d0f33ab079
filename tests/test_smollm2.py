"""The real pair (`model=smollm2`: SmolLM2-135M-Instruct and the project's EAGLE-3 head for
it): losslessness on a real target. Slow (a 135M target on CPU); they need `make smollm2`
first and say so when the file is missing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from decode.baseline import autoregressive_decode
from decode.stream import DecodeSettings
from pairs.config import ModelConfig
from pairs.models import load_model_pair
from pairs.prompts import encode_prompt
from specrank.settings.paths import CONF_DIR, project_path
from tests.recording import decode_recorded, greedy_acceptance
from tests.test_decode_sampling import ALPHA, _chi_square_p
from tests.tiny_models import one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def smollm2():
    yaml = OmegaConf.load(CONF_DIR / "model" / "smollm2.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    if not project_path(cfg.target).is_file():
        pytest.skip(f"{cfg.target} is not fetched: run `{cfg.fetch}`")
    cfg = dataclasses.replace(
        cfg, target=str(project_path(cfg.target)), drafter=str(project_path(cfg.drafter)),
        dtype="float32",  # exact greedy equality: a bf16 near-tie could flip an argmax
    )  # fmt: skip
    with one_thread():
        yield load_model_pair(cfg)


@pytest.mark.parametrize(("budget", "pool"), [(8, PoolConfig(top_k=8, expand_steps=3, expand=8)),
                                              (59, PoolConfig())])  # fmt: skip
def test_greedy_on_the_real_pair_equals_plain_greedy(smollm2, budget, pool):
    s = DecodeSettings(
        pool=pool, select=SelectConfig(budget=budget), decode=DecodeConfig(max_new_tokens=32)
    )
    with one_thread():
        accepted, rounds = greedy_acceptance(smollm2, PROMPTS, s)
    assert accepted > rounds // 2  # the trained head drafts: about 1.5 tokens a round or more


def _first_two_law(target, prompt: list[int], top: int) -> tuple[dict, float]:
    """P(x1, x2) for x1 among the target's `top` first tokens and x2 among each one's `top`
    next; every other outcome is one cell (its probability: what the rest leave)."""
    with torch.inference_mode():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
        firsts = p1.topk(top).indices.tolist()
        seqs = torch.tensor([[*prompt, x] for x in firsts])
        p2 = torch.softmax(target(input_ids=seqs).logits[:, -1].float(), -1)
    law = {}
    for i, x1 in enumerate(firsts):
        for x2 in p2[i].topk(top).indices.tolist():
            law[(x1, x2)] = float(p1[x1] * p2[i, x2])
    return law, 1.0 - sum(law.values())


def test_sampling_on_the_real_pair_follows_the_targets_law(smollm2):
    """300 sampled two-token outputs (T=1, exhaustive verification, a B=8 tree) against the
    target's exact law over its 6 x 6 likeliest first two tokens and the rest: Pearson's
    chi-square over cells expected >= 5, p > ALPHA; drafts are accepted (the tree is used)."""
    prompt = encode_prompt(smollm2.tokenizer, "Name a fruit and a color.")
    law, rest = _first_two_law(smollm2.target, prompt, 6)
    s = DecodeSettings(
        pool=PoolConfig(top_k=8, expand_steps=3, expand=8), select=SelectConfig(budget=8),
        decode=DecodeConfig(temperature=1.0, max_new_tokens=2),
    )  # fmt: skip
    cells = {k: i for i, k in enumerate(law)}
    counts = np.zeros(len(cells) + 1)
    accepted = 0
    with one_thread():
        for i in range(300):
            res = decode_recorded(smollm2.target, smollm2.drafter, prompt, s, frozenset(), f"p{i}")
            counts[cells.get(tuple(res.output[:2]), len(cells))] += 1
            accepted += sum(res.accepted)
    assert accepted > 30
    p = _chi_square_p(counts, np.array([*law.values(), rest]))
    assert p > ALPHA, f"chi-square p = {p:.2e}"


def test_the_converted_target_decodes_as_its_gguf_source_says(smollm2):
    prompt = encode_prompt(smollm2.tokenizer, PROMPTS[0])
    out = autoregressive_decode(smollm2.target, prompt, 12)
    assert "Paris" in smollm2.tokenizer.decode(out)


@pytest.mark.parametrize("kind", ["block", "dspark", "domino"])
def test_greedy_with_each_block_family_drafter_equals_plain_greedy(kind):
    """The block-family drafters trained for SmolLM2 (`models/smollm2/<kind>`) decode
    losslessly on the real target, and draft: weaker than the head (tau about 1.3-1.4)."""
    yaml = OmegaConf.load(CONF_DIR / "model" / f"smollm2_{kind}.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), yaml))
    if not project_path(cfg.target).is_file():
        pytest.skip(f"{cfg.target} is not fetched: run `{cfg.fetch}`")
    cfg = dataclasses.replace(
        cfg, target=str(project_path(cfg.target)), drafter=str(project_path(cfg.drafter))
    )
    s = DecodeSettings(
        pool=PoolConfig(top_k=8, expand_steps=3, expand=8), select=SelectConfig(budget=8),
        decode=DecodeConfig(max_new_tokens=32),
    )  # fmt: skip
    with one_thread():
        accepted, rounds = greedy_acceptance(load_model_pair(cfg), PROMPTS, s)
    assert accepted > rounds // 5
