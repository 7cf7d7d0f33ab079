"""The pocket semi-AR drafters (DSpark, Domino; `recipes.pocket.semiar`): the training forward
equals drafting, each loss and the confidence calibration on tiny tensors, the recipe ships a
drafter in its reference's layout that decodes losslessly, and the shipped ones load, decode
greedily equal to target-only and get drafts accepted."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from decode.stream import DecodeSettings
from decode.train_pocket.semiar import train_and_measure
from pairs.models import load_model_pair
from pairs.semiar.layout import READERS
from recipes.pocket.block import Window
from recipes.pocket.config import PocketDominoConfig, PocketDSparkConfig, TrainConfig
from recipes.pocket.domino import DominoLoss, lambda_base
from recipes.pocket.dspark import dspark_terms, dspark_weights, ece, prefix_nll, sts_fit, sts_scores
from recipes.pocket.eagle3 import target_view
from recipes.pocket.semiar import teacher_forced
from specrank.settings.paths import PROJECT_ROOT
from tests.eagle3_heads import tiny_target
from tests.recording import greedy_acceptance
from tests.semiar_drafters import semiar_model_config, write_semiar
from tests.test_eagle3_pocket import _suite
from tests.tiny_models import one_thread
from tree.attention import forward_chain, new_cache
from tree.config import DecodeConfig, PoolConfig, SelectConfig

POCKET = PROJECT_ROOT / "models" / "pocket"
CONFIGS = {"dspark": PocketDSparkConfig, "domino": PocketDominoConfig}


VARIANTS = [
    ("dspark", {"head": "vanilla"}),
    ("dspark", {"head": "gated"}),
    ("domino", {"prefix": 1}),
    ("domino", {"shift_label": True, "prefix": 2}),
]


@pytest.mark.parametrize(("kind", "kw"), VARIANTS)
def test_the_training_forward_equals_drafting(tmp_path, kind, kw):
    """Anchor a's teacher-forced rows = the decoder's corrected rows down the data's path, node
    by node (`SemiARModule.correct`), the context from cached target passes (atol 1e-4)."""
    target_dir = tiny_target(tmp_path, "qwen3")
    folder = write_semiar(kind, tmp_path / kind, target_dir, init_std=0.1, **kw)
    pair = load_model_pair(semiar_model_config(kind, target_dir, folder))
    d, spec = pair.drafter, pair.drafter.semi
    x = torch.randint(3, 90, (1, 24), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([3, 9, 12])
    rows = anchors[:, None] + torch.arange(spec.depth)
    with one_thread(), torch.no_grad():
        feats, logp = target_view(pair.target, x, spec.block.capture_ids)
        win = Window(feats[0], logp[0], x[0], anchors, rows, torch.ones(rows.shape))
        trained = teacher_forced(d.module, spec, pair.target, win).final
        for i, a in enumerate(anchors.tolist()):
            cache = new_cache(pair.target)
            state = d.new_state(cache)
            forward_chain(pair.target, x[0, :a], cache)
            hidden = d.block_hidden(state, int(x[0, a]), a)
            hidden = hidden[: spec.depth] if spec.shift else hidden[1 : spec.depth + 1]
            node_state = None
            for j in range(spec.depth):
                prev = x[0, a + j : a + j + 1]
                bias, node_state = d.module.correct(j, hidden[j], prev, d.gru_embed, node_state)
                want = d.lm_head(hidden[j]) + (0 if bias is None else bias[0])
                torch.testing.assert_close(trained[i, j], want, atol=1e-4, rtol=1e-5)


def test_the_domino_curriculum_moves_from_base_to_final():
    """SpecForge's linear_lambda_base: start -> 0 over the first decay_ratio of the run."""
    assert [lambda_base(p, 1.0, 0.5) for p in (0.0, 0.25, 0.5, 0.9)] == [1.0, 0.5, 0.0, 0.0]
    assert lambda_base(0.5, 0.8, 1.0) == pytest.approx(0.4)
    pc = PocketDominoConfig(train=TrainConfig(steps=4, max_minutes=1e6))
    loss = DominoLoss(None, SimpleNamespace(depth=8), None, pc)
    weights = [loss.weight() for _ in range(5)]  # by steps (the time cap is far)
    assert weights == pytest.approx([1.0, 0.5, 0.0, 0.0, 0.0], abs=1e-6)


def test_dspark_weights_decay_along_the_block():
    """DeepSpec's exp(-k / gamma) over rows k = 0 .. D - 1, normalised to mean 1."""
    w = dspark_weights(4, 2.0)
    raw = torch.exp(-torch.arange(4.0) / 2.0)
    torch.testing.assert_close(w, raw / raw.mean())
    assert (w[1:] < w[:-1]).all()


def test_dspark_terms_are_the_total_variation_and_its_bce():
    """q = (.5, .5), p = (1, 0): sum |q - p| = 1 = 2 TV, acceptance 1 - TV = .5; a zero logit's
    BCE towards .5 is ln 2."""
    logq = torch.tensor([[0.5, 0.5]]).log()
    l1, accept, bce = dspark_terms(logq, torch.tensor([[1.0, 0.0]]), torch.zeros(1))
    torch.testing.assert_close((l1, accept, bce), (torch.ones(1), torch.full((1,), 0.5),
                                                   torch.full((1,), math.log(2))))  # fmt: skip


def test_sequential_temperature_scaling_undoes_overconfidence():
    """Logits 3x a true per-step acceptance's: STS finds T ~ 3 per position, left to right,
    and the cumulative product's ECE and NLL fall on held-out blocks."""
    rng = np.random.default_rng(0)
    accept = rng.uniform(0.3, 0.97, (8000, 4))
    logits = 3.0 * np.log(accept / (1 - accept))
    temps = sts_fit(logits[:4000], accept[:4000], 20)
    assert np.allclose(temps, 3.0, rtol=0.1), temps
    before = sts_scores(logits[4000:], accept[4000:], np.ones(4), 20)
    after = sts_scores(logits[4000:], accept[4000:], temps, 20)
    for q in ("ece", "nll"):
        assert all(a < b for a, b in zip(after[q], before[q], strict=True)), (q, before, after)
    assert ece(np.array([0.3, 0.3]), np.array([0.3, 0.3]), 10) == 0.0
    assert prefix_nll(np.array([0.5]), np.array([1.0])) == pytest.approx(math.log(2))


@pytest.mark.parametrize("kind", ["dspark", "domino"])
def test_the_recipe_ships_a_drafter_that_decodes_losslessly(tmp_path, kind):
    """A 3-step run in the reference layout, read back by the loader, its held-out tau
    measured by decoding (greedy output equal to target-only's) and carded."""
    pc = CONFIGS[kind](out_dir=str(tmp_path / kind), code_chars=60_000, rollout_prompts=8,
                       rollout_tokens=8, card_prompts=1, card_tokens=8)  # fmt: skip
    if kind == "dspark":
        pc.calibration_tokens = 2048
    pc.train = replace(pc.train, steps=3, batch=2, seq_len=32, warmup=1, eval_every=3)
    with one_thread():
        facts = train_and_measure(kind, pc)
    spec = READERS[kind](tmp_path / kind)
    assert (spec.depth, spec.block.target_layer_ids) == (8, (0, 1, 2))
    assert facts["train"]["steps"] == 3 and facts["heldout"]["lossless"]
    card = (tmp_path / kind / "MODEL_CARD.md").read_text()
    assert "online tau at B=8" in card and f"{facts['heldout']['tau']:.3f}" in card
    if kind == "dspark":
        assert len(facts["sts"]["temperatures"]) == 8 and "Sequential Temperature" in card


@pytest.mark.parametrize(("kind", "setting", "value"), [
    ("dspark", "markov_head_type", "rnn"), ("dspark", "labels", "soft"),
    ("domino", "lambda_base_decay_ratio", 0.0), ("domino", "pure_draft_prefix_len", 8),
])  # fmt: skip
def test_a_bad_setting_is_refused_before_any_data(tmp_path, monkeypatch, kind, setting, value):
    pc = CONFIGS[kind](out_dir=str(tmp_path / "d"), **{setting: value})
    monkeypatch.setattr("recipes.pocket.block.training_data", lambda *a: pytest.fail("data"))
    with pytest.raises(ValueError, match=rf"pocket_{kind}.{setting}: expected"):
        train_and_measure(kind, pc)


@pytest.mark.parametrize("kind", ["dspark", "domino"])
def test_the_shipped_drafter_is_small_documented_and_drafts(kind):
    """Greedy output equal to the target's (greedy_acceptance checks it), drafts accepted."""
    folder = POCKET / kind
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "MODEL_CARD.md", "recipe.json"} <= files.keys()
    assert files["model.safetensors"] < 3_000_000
    spec = READERS[kind](folder)
    assert (spec.depth, spec.block.target_layer_ids, spec.block.mask_token_id) == (8, (0, 1, 2), 0)
    facts = json.loads((folder / "recipe.json").read_text())
    card = (folder / "MODEL_CARD.md").read_text()
    assert f"{facts['params']:,}" in card and f"**tau {facts['heldout']['tau']:.3f}**" in card
    pair = load_model_pair(semiar_model_config(kind, POCKET / "target", folder))
    s = DecodeSettings(pool=PoolConfig(top_k=6, expand_steps=5, expand=6), select=SelectConfig(budget=7),
                       decode=DecodeConfig(max_new_tokens=32))  # fmt: skip
    with one_thread():
        accepted, rounds = greedy_acceptance(pair, [p.text for p in _suite(2)], s)
    assert accepted > rounds // 4
