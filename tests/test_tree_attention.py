"""Tree attention: rows under the tree mask equal sequential rows; cache compaction is exact."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import one_thread, tiny_pair
from tree.attention import (
    ancestor_matrix,
    cache_kwarg,
    cache_length,
    compact_cache,
    forward_chain,
    forward_tree,
    new_cache,
    to_attention_mask,
    tree_visibility,
)

CONTEXT = [5, 9, 20, 33, 41, 8, 77]
# A small trie below the root (the root is the last context token): pool order.
PARENT = torch.tensor([-1, -1, -1, 0, 0, 1, 3, 3, 5, 6])
TOKENS = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
DEPTH = torch.tensor([1, 1, 1, 2, 2, 2, 3, 3, 3, 4])
# Rows computed one at a time may differ from batched rows by float32 rounding only.
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    with one_thread():
        yield {impl: tiny_pair(root, request.param, attn=impl).target for impl in ("eager", "sdpa")}


def test_ancestor_matrix_on_a_hand_built_trie():
    anc = ancestor_matrix(PARENT, max_depth=4)
    assert torch.nonzero(anc[9])[:, 0].tolist() == [0, 3, 6, 9]
    assert torch.nonzero(anc[8])[:, 0].tolist() == [1, 5, 8]
    assert torch.nonzero(anc[2])[:, 0].tolist() == [2]
    assert int(anc.sum()) == int(DEPTH.sum())  # each node: itself + (depth - 1) ancestors


def _sequential_rows(model, context: list[int]) -> torch.Tensor:
    anc = ancestor_matrix(PARENT, 4)
    rows = []
    for i in range(len(TOKENS)):
        path = torch.nonzero(anc[i])[:, 0]
        seq = torch.tensor(context + TOKENS[path].tolist())
        rows.append(model(input_ids=seq[None]).logits[0, -1])
    return torch.stack(rows).float().log_softmax(-1)  # [n, V]


def _root_and_trie_pass(model):
    """Prefill CONTEXT[:-1], then one tree pass over [root | trie]; (cache, n_ctx, logits)."""
    cache = new_cache(model)
    forward_chain(model, torch.tensor(CONTEXT[:-1]), cache)
    n_ctx = cache_length(cache)
    # Batch = [root | trie]: every node sees the root and its own ancestors;
    # positions = prefix length + depth.
    new = torch.zeros(11, 11, dtype=torch.bool)
    new[:, 0] = True
    new[1:, 1:] = ancestor_matrix(PARENT, 4)
    ids = torch.cat([torch.tensor(CONTEXT[-1:]), TOKENS])
    pos = torch.cat([torch.tensor([n_ctx]), n_ctx + DEPTH])
    logits = forward_tree(model, ids, pos, tree_visibility(n_ctx, new[:, :0], new), cache)
    return cache, n_ctx, logits


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tree_rows_equal_sequential_rows(models, impl):
    model = models[impl]
    with one_thread(), torch.inference_mode():
        _, _, tree = _root_and_trie_pass(model)
        tree = tree.float().log_softmax(-1)
        seq = _sequential_rows(model, CONTEXT)
        root = model(input_ids=torch.tensor([CONTEXT])).logits[0, -1].float().log_softmax(-1)
    assert (tree[1:] - seq).abs().max() < TOL
    assert (tree[0] - root).abs().max() < TOL


@pytest.mark.parametrize("trap", ["boolean mask under eager", "no position ids"])
def test_traps_the_module_avoids_are_real(models, trap):
    """Each trap alone gives rows far from the sequential ones (so the module must avoid it)."""
    model = models["eager"]
    with one_thread(), torch.inference_mode():
        anc = ancestor_matrix(PARENT, 4)
        vis = tree_visibility(len(CONTEXT), anc[:, :0], anc)
        cache = new_cache(model)
        forward_chain(model, torch.tensor(CONTEXT), cache)
        if trap == "boolean mask under eager":
            kw = {
                "attention_mask": vis[None, None],
                "position_ids": (len(CONTEXT) - 1 + DEPTH)[None],
            }
        else:
            kw = {"attention_mask": to_attention_mask(vis, model.dtype, "eager")}
        wrong = model(input_ids=TOKENS[None], cache=cache, **kw).logits[0]
        seq = _sequential_rows(model, CONTEXT)
    assert (wrong.float().log_softmax(-1) - seq).abs().max() > 100 * TOL


def test_mask_forms():
    vis = torch.tensor([[True, False], [True, True]])
    assert to_attention_mask(vis, torch.float32, "sdpa").dtype == torch.bool
    add = to_attention_mask(vis, torch.bfloat16, "eager")
    assert add.dtype == torch.bfloat16 and add.shape == (1, 1, 2, 2)
    assert add[0, 0, 0, 0] == 0 and add[0, 0, 0, 1] == torch.finfo(torch.bfloat16).min
    with pytest.raises(ValueError, match=r"'sdpa' or 'eager'. Got 'flash'"):
        to_attention_mask(vis, torch.float32, "flash")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_compaction_keeps_exactly_the_accepted_path(models, impl):
    """After keeping root + path (0, 3, 6), the next row equals the row of the plain sequence."""
    model = models[impl]
    with one_thread(), torch.inference_mode():
        cache, n_ctx, _ = _root_and_trie_pass(model)
        compact_cache(cache, n_ctx + 1, [n_ctx + 1 + i for i in (0, 3, 6)])
        assert cache_length(cache) == len(CONTEXT) + 3
        nxt = forward_chain(model, torch.tensor([42]), cache)[-1].float().log_softmax(-1)
        full = CONTEXT + TOKENS[[0, 3, 6]].tolist() + [42]
        ref = model(input_ids=torch.tensor([full])).logits[0, -1].float().log_softmax(-1)
    assert (nxt - ref).abs().max() < TOL


def test_forward_tree_checks_the_visibility_shape(models):
    model = models["sdpa"]
    with torch.inference_mode():
        cache = new_cache(model)
        with pytest.raises(
            ValueError, match=r"visibility must be \[n, cache_length \+ n\] = \[2, 2\]"
        ):
            forward_tree(
                model,
                torch.tensor([1, 2]),
                torch.tensor([0, 1]),
                torch.ones(2, 3, dtype=torch.bool),
                cache,
            )


def test_compaction_refuses_positions_outside_the_tree(models):
    model = models["sdpa"]
    with torch.inference_mode():
        cache = new_cache(model)
        forward_chain(model, torch.tensor(CONTEXT), cache)
        with pytest.raises(ValueError, match="kept positions must ascend"):
            compact_cache(cache, 5, [3])


def test_the_cache_argument_follows_the_forward_the_model_declares():
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"
    hooked = New()  # an instance whose forward was replaced (accelerate's hooks do this)
    hooked.forward = lambda input_ids, past_key_values=None: None
    assert cache_kwarg(hooked) == "past_key_values" and cache_kwarg(New()) == "cache"
