"""The lean drafting forwards (tree.lean, tree.lean_model, pairs.eagle3.lean) give the rows
of the transformers modules bit for bit: a standalone Llama over its static cache, and an
EAGLE-3 head, on chains and under tree masks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pairs.eagle3.lean import lean_head
from pairs.eagle3.pool import run_head
from tests.eagle3_heads import head_spec, random_head, tiny_target
from tests.gguf_files import tiny_llama
from tree.attention import (
    compact_cache,
    draft_cache,
    forward_chain,
    forward_tree,
    new_cache,
    tree_visibility,
)
from tree.config import PoolConfig
from tree.growth import grow_pool
from tree.lean import StaticKV, additive_mask
from tree.lean_model import supports


@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_static_cache_rows_and_pools_equal_the_dynamic_caches(bias):
    model = tiny_llama(seed=3)  # grouped-query attention: 4 heads, 2 key/value heads
    if bias:  # q, k, v and o biases (random: transformers initializes them to zero)
        model.config.attention_bias = True
        model = type(model)(model.config).eval()
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(generator=torch.Generator().manual_seed(len(name)))
    assert supports(model)
    ids = torch.randint(2, 1024, (30,), generator=torch.Generator().manual_seed(0))
    dyn, static = new_cache(model), draft_cache(model)
    assert isinstance(static, StaticKV)
    assert torch.equal(forward_chain(model, ids[:20], dyn), forward_chain(model, ids[:20], static))
    # a tree of three nodes: 0 <- 1, and 2 alone, at depths 1, 2, 1
    vis = tree_visibility(20, torch.zeros(3, 0, dtype=torch.bool),
                          torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool))  # fmt: skip
    pos = torch.tensor([20, 21, 20])
    tree = ids[20:23]
    assert torch.equal(forward_tree(model, tree, pos, vis, dyn),
                       forward_tree(model, tree, pos, vis, static))  # fmt: skip
    for c in (dyn, static):
        compact_cache(c, 20, [21])
    cfg = PoolConfig(top_k=4, expand_steps=3, expand=3)
    a = grow_pool(model, dyn, ids[21:24], 23, cfg)
    b = grow_pool(model, static, ids[21:24], 23, cfg)
    for f in ("token", "parent", "depth", "draft_logprob", "score", "expanded", "anc",
              "drafter_pos"):  # fmt: skip
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("before_residual", [False, True])
@torch.inference_mode()
def test_the_lean_head_gives_the_modules_outputs(tmp_path, before_residual):
    target = tiny_target(tmp_path, "llama", layers=4)
    spec = head_spec(target, n_layers=2, aux=(1, 2, 3), norm_before_residual=before_residual)
    spec = dataclasses.replace(spec, draft_vocab_size=spec.layer.vocab_size)
    head = random_head(spec, 3, own_embed=True)
    lean = lean_head(head)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(12, 3 * spec.target_hidden_size, generator=g)
    ids = torch.randint(0, spec.layer.vocab_size, (12,), generator=g)
    vis = torch.ones(12, 12, dtype=torch.bool).tril()
    want = run_head(head, head.fuse(feats), ids, torch.arange(12), vis, new_cache_of(head))
    cache = lean.new_cache()
    hidden = torch.mm(feats, lean.fuse_w)
    got = lean.forward(hidden, lean.hidden_norm(hidden), ids, lean.rope.at(12)[:12],
                       cache.slots(0, 12), additive_mask(vis, hidden.dtype))  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(lean.outputs(got), head.logits(want))
    assert torch.equal(lean.hidden_norm(got), head.layers[0].hidden_norm(want))


def new_cache_of(head):
    from transformers import DynamicCache

    return DynamicCache(config=head.config)
