"""`model.drafter_window`: a block-family drafter attending to its latest W context positions.

Exact by construction (context keys are rotated to their absolute positions when computed),
so: W at least the context changes nothing, bit for bit; a small W equals a from-scratch
forward over the last W positions alone, and differs from the whole context's; the held K/V
stays W long. The setting is refused by name before anything loads, the pocket configs set
the window their recipes trained on, and the cards say so (regenerated from recipe.json).
Greedy losslessness with a window: tests/test_block_drafter.py, tests/test_semiar_drafter.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from omegaconf import OmegaConf

from pairs.config import ModelConfig
from pairs.models import drafter_kind, load_model_pair
from pairs.prompts import encode_prompt
from recipes.pocket import block_card, semiar_card
from recipes.pocket.block import trained_context, training_windows
from specrank.settings.errors import Refusal
from specrank.settings.paths import PROJECT_ROOT
from tests.block_drafters import block_config, write_block
from tests.eagle3_heads import tiny_target
from tests.semiar_drafters import semiar_model_config, write_semiar
from tests.tiny_models import one_thread
from tree.attention import forward_chain, new_cache

TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))"
POCKET = PROJECT_ROOT / "models" / "pocket"


@pytest.fixture(scope="module", params=["block", "domino"])
def pair(request, tmp_path_factory):
    """A tiny qwen3 target (7 layers) with a random block or Domino drafter (whole context)."""
    root = tmp_path_factory.mktemp(f"window_{request.param}")
    target = tiny_target(root, "qwen3")
    if request.param == "block":
        cfg = block_config(target, write_block(root / "block", target, seed=4))
    else:
        cfg = semiar_model_config("domino", target, write_semiar("domino", root / "d", target))
    with one_thread():
        return load_model_pair(cfg)


def _rounds(pair, window: int | None, tokens: list[int], roots: tuple[int, ...]):
    """Each round's block hidden states, the context fed from the decoding passes' captured
    states (as decoding feeds it), and the drafter state after the last round."""
    d = dataclasses.replace(pair.drafter, window=window)
    out, fed = [], 0
    with one_thread(), torch.inference_mode():
        cache = new_cache(pair.target)
        state = d.new_state(cache)
        for r in roots:
            forward_chain(pair.target, torch.tensor(tokens[fed:r]), cache)
            out.append(d.block_hidden(state, tokens[r], r))
            fed = r
    return out, state


def _from_scratch(pair, tokens: list[int], r: int, window: int) -> torch.Tensor:
    """The block at root position r over the context [r - W, r) alone: the target's states of
    one plain forward, only the last W of them made into the drafter's context."""
    d = pair.drafter
    lo = max(r - window, 0)
    with torch.inference_mode():
        hs = pair.target(input_ids=torch.tensor([tokens[:r]]), output_hidden_states=True)
        feats = torch.cat([hs.hidden_states[i + 1][0] for i in d.spec.target_layer_ids], -1)
        ctx = d.module.context(feats[lo:r], torch.arange(lo, r))
        ids = torch.tensor([tokens[r]] + [d.spec.mask_token_id] * (d.spec.block_size - 1))
        return d.module(d.embed(ids), torch.arange(r, r + len(ids)), ctx)


def test_a_window_at_least_the_context_changes_nothing_bit_for_bit(pair):
    tokens = encode_prompt(pair.tokenizer, TEXT)
    roots = (5, 9, len(tokens) - 1)
    whole, _ = _rounds(pair, None, tokens, roots)
    for window in (roots[-1], 10_000):
        cut, state = _rounds(pair, window, tokens, roots)
        assert all(torch.equal(a, b) for a, b in zip(whole, cut, strict=True)), window
        assert state.ctx[0][0].shape[1] == roots[-1]


@pytest.mark.parametrize("window", [1, 3])
def test_a_small_window_is_a_forward_over_the_last_w_positions_alone(pair, window):
    tokens = encode_prompt(pair.tokenizer, TEXT)
    roots = (5, 9, len(tokens) - 1)
    assert roots[-1] > 9 + window  # later rounds' windows drop positions fed rounds before
    cut, state = _rounds(pair, window, tokens, roots)
    whole, _ = _rounds(pair, None, tokens, roots)
    for r, hidden, full in zip(roots, cut, whole, strict=True):
        # float32; atol 1e-4, rtol 1e-5: cached target passes round apart from one plain pass
        want = _from_scratch(pair, tokens, r, window)
        torch.testing.assert_close(hidden, want, atol=1e-4, rtol=1e-5)
        assert (hidden - full).abs().max() > 1e-3  # the cut context drafts otherwise
    # the held K/V is trimmed as it is held: memory bounded by W, whatever the context
    assert all(k.shape[1] == v.shape[1] == window for k, v in state.ctx)
    assert state.n_fed == roots[-1]


def test_the_manifest_records_a_window_and_nothing_without_one(pair, tmp_path):
    assert "drafter_window" not in pair.ids
    cfg = dataclasses.replace(_config_of(pair), drafter_window=7)
    with one_thread():
        windowed = load_model_pair(cfg)
    assert windowed.drafter.window == 7 and windowed.ids["drafter_window"] == "7"


def _config_of(pair) -> ModelConfig:
    kind = pair.ids["drafter_kind"]
    return ModelConfig(name="w", target=pair.ids["target"], drafter=pair.ids["drafter"],
                       drafter_kind=kind)  # fmt: skip


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "120"])
def test_a_bad_window_is_refused_by_name_before_anything_loads(value):
    cfg = ModelConfig(name="w", target="/nonexistent/t", drafter="/nonexistent/d",
                      drafter_kind="domino", drafter_window=value)  # fmt: skip
    message = (r"The 'model.drafter_window' must be null \(the whole context\) or an int >= 1 "
               rf".*Got {value!r} instead")  # fmt: skip
    with pytest.raises(Refusal, match=message):
        drafter_kind(cfg)
    with pytest.raises(Refusal, match=message):  # not the missing folders' FileNotFoundError
        load_model_pair(cfg)


@pytest.mark.parametrize("kind", ["standalone", "eagle3"])
def test_a_window_is_refused_for_drafters_with_their_own_cache(kind):
    cfg = ModelConfig(name="w", target="t", drafter="d", drafter_kind=kind, drafter_window=120)
    with pytest.raises(Refusal, match=r"The 'model.drafter_window' applies to "
                       r"model.drafter_kind=block \| dspark \| domino only. Got 120 with "
                       rf"model.drafter_kind='{kind}'"):  # fmt: skip
        drafter_kind(cfg)
    for ok in ("block", "dspark", "domino"):
        drafter_kind(dataclasses.replace(cfg, drafter_kind=ok))
    assert ModelConfig().drafter_window is None  # user checkpoints: the whole context


def test_trained_context_is_the_largest_context_a_training_block_sees(monkeypatch):
    """An anchor a's block attends to [0, a): the largest anchor drawn is `trained_context`."""
    seq_len, depth, n = 32, 8, 4000
    x = torch.zeros(1, seq_len + 1, dtype=torch.long)  # a training window: seq_len + 1 tokens
    monkeypatch.setattr("recipes.pocket.block.target_view", lambda *a: (x[..., None], x[..., None]))
    spec = type("Spec", (), {"capture_ids": ()})()
    win = next(training_windows(None, spec, x, torch.ones(1, seq_len), depth, n,
                                torch.Generator().manual_seed(0)))  # fmt: skip
    assert int(win.anchors.max()) == trained_context(seq_len, depth) == 24
    assert int(win.rows.max()) + 1 == seq_len  # the last row's token is the window's last


CARDS = {"block": block_card, "block_dcore": block_card, "dspark": semiar_card,
         "domino": semiar_card}  # fmt: skip


@pytest.mark.parametrize("name", list(CARDS))
def test_the_pocket_configs_set_the_window_their_recipes_trained_on(name, tmp_path):
    """conf/model/pocket_<name>.yaml's window is the recipe's trained context, and the shipped
    card and recipe.json are their generator's output (regeneration loses nothing)."""
    folder = POCKET / name
    facts = json.loads((folder / "recipe.json").read_text())
    depth = facts.get("depth", facts["config"]["block_size"] - 1)
    assert facts["context_window"] == trained_context(facts["config"]["train"]["seq_len"], depth)
    conf = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / f"pocket_{name}.yaml")
    assert conf.drafter_window == facts["context_window"] == 120
    CARDS[name].write_card(tmp_path, facts)
    for file in ("MODEL_CARD.md", "recipe.json"):
        assert (tmp_path / file).read_text() == (folder / file).read_text(), file
    card = (folder / "MODEL_CARD.md").read_text()
    assert "## Context window" in card and "`model.drafter_window: 120`" in card


def test_a_store_recorded_before_the_setting_keeps_its_manifest():
    """null is every drafter's behaviour from before the setting: the model section's view
    in a trace manifest leaves it out, so stores recorded before it resume; a window shows."""
    from decode.config import manifest_view

    assert manifest_view({"model": {"name": "m", "drafter_window": None}})["model"] == {"name": "m"}
    view = manifest_view({"model": {"name": "m", "drafter_window": 120}})
    assert view["model"] == {"name": "m", "drafter_window": 120}
