"""Temperature pairs T_t|T_d (`decode.draft_temperature`): sampled drafting draws children from
the drafter's tempered distribution, null keeps today's drafts, and the output law stays the
target's at 1|1 for every drafter kind and verifier."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decode.stream import DecodeSettings
from pairs.block.drafter import attach_block, read_block
from pairs.config import ModelConfig
from pairs.models import load_causal_lm
from tests.block_drafters import block_config, write_block
from tests.recording import decode_recorded
from tests.test_decode_sampling import (
    PROMPT,
    TINY_V,
    _chi_square_p,
    assert_samples_follow_the_target_law,
)
from tests.tiny_models import build_tiny_pair, one_thread
from tree.config import DecodeConfig, PoolConfig, SelectConfig
from tree.pool import DraftDraw, _children, stable_topk

N_RUNS = 250  # as the other law tests; `-m slow` runs 3,000


def test_sampled_children_follow_the_tempered_law_without_replacement():
    """The first of k Gumbel-top-k children is a draw from softmax(logits / T) (chi-square over
    4,000 rows, p > 1e-3); the k are distinct; their scores are the tempered log-probs."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    rows = logits.expand(4000, -1)
    draw = DraftDraw(0.7, torch.Generator().manual_seed(3))
    idx, vals, _ = _children(rows, 3, draw)
    idx, vals = idx.view(4000, 3), vals.view(4000, 3)
    assert all(len(set(r)) == 3 for r in idx.tolist())
    tempered = (logits / 0.7).log_softmax(-1)
    torch.testing.assert_close(vals, tempered[idx])
    counts = np.bincount(idx[:, 0].numpy(), minlength=6)
    assert _chi_square_p(counts, tempered.exp().double().numpy()) > 1e-3


def test_without_a_draw_the_children_are_the_top_k_at_unit_temperature():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    idx, vals, _ = _children(logits, 4)
    want_vals, want_idx = stable_topk(logits.log_softmax(-1), 4)
    assert torch.equal(idx, want_idx.reshape(-1)) and torch.equal(vals, want_vals.reshape(-1))


@pytest.mark.parametrize(("pair", "message"), [
    ((0.0, 1.0), r"decode.draft_temperature=1 with decode.temperature=0: sampled drafting"),
    ((1.0, -0.5), r"'decode.draft_temperature' must be"),
])  # fmt: skip
def test_bad_pairs_are_refused_by_name(pair, message):
    s = DecodeSettings(decode=DecodeConfig(temperature=pair[0], draft_temperature=pair[1]))
    with pytest.raises(ValueError, match=message):
        s.check()


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """The 8-token target, its noisy-copy standalone drafter and a random block drafter."""
    root = tmp_path_factory.mktemp("tinyv_td")
    with one_thread():
        build_tiny_pair(root, "llama", vocab_size=TINY_V, init_std=0.6, draft_noise=0.3, layers=7)
        cfg = ModelConfig(name="t", target=str(root / "target"), drafter=str(root / "drafter"))
        target = load_causal_lm(cfg.target, cfg, "model.target")
        standalone = load_causal_lm(cfg.drafter, cfg, "model.drafter")
        block_dir = write_block(root / "block", root / "target", seed=1, init_std=0.6)
        bcfg = block_config(root / "target", block_dir)
        block = attach_block(read_block(block_dir, target.config), target, bcfg)
        yield target, {"standalone": standalone, "block": block}


@pytest.mark.parametrize("n", [N_RUNS, pytest.param(3000, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("kind", "verifier"), [
    ("block", "exhaustive"), ("block", "eagle3"), ("standalone", "exhaustive"),
    pytest.param("standalone", "eagle3", marks=pytest.mark.slow),  # the default suite's time
])  # fmt: skip
def test_sampled_drafting_keeps_the_target_law(tiny_vocab, kind, verifier, n):
    """1|1: chi-square over the first two tokens, as at 1|0."""
    target, drafters = tiny_vocab
    assert_samples_follow_the_target_law(target, drafters[kind], verifier, n, draft_temperature=1.0)


def test_null_and_zero_draft_the_same_and_one_draws_other_trees(tiny_vocab):
    """T_d = 0 is today's drafting under its label; T_d = 1 draws (the trees differ)."""
    target, drafters = tiny_vocab
    out = {}
    for t_d in (None, 0.0, 1.0):
        s = DecodeSettings(pool=PoolConfig(top_k=3, expand_steps=2, expand=2), select=SelectConfig(budget=5),
                           decode=DecodeConfig(temperature=1.0, max_new_tokens=12,
                                               draft_temperature=t_d))  # fmt: skip
        with one_thread():
            res = decode_recorded(target, drafters["standalone"], PROMPT, s, frozenset(),
                                  prompt_id="x", record=True)  # fmt: skip
        out[t_d] = [(list(r["cand_token"]), list(r["accepted_path"])) for r in res.rounds]
    assert out[None] == out[0.0]
    assert out[1.0] != out[None]


def test_pairs_are_labelled_as_the_paper_and_keyed_as_mlflow_accepts():
    from specrank.statistics.laws import pair_key, pair_label

    assert (pair_label(0.0, None), pair_label(1.0, 0.0), pair_label(1.0, 1.0)) == (
        "0|0", "1|0", "1|1")  # fmt: skip
    assert (pair_key(1.0, None), pair_key(0.7, 0.5)) == ("t1_d0", "t0p7_d0p5")


def test_the_manifest_records_the_drafter_temperature_only_when_set():
    """null is the drafting of stores recorded before the setting: their manifests, and so
    their resumption, are unchanged; 0 and above are recorded."""
    from decode.config import manifest_view

    view = manifest_view({"decode": {"seed": 0, "draft_temperature": None}})
    assert view["decode"] == {"seed": 0}
    view = manifest_view({"decode": {"seed": 0, "draft_temperature": 0.0}})
    assert view["decode"] == {"seed": 0, "draft_temperature": 0.0}
