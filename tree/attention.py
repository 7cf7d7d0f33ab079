"""Tree attention on top of a Hugging Face KV cache: masks, positions, forwards, compaction.

A tree forward puts many prefixes of one context on the sequence axis. Each new
position must see the whole committed context plus its own ancestors, and sit
at position `prefix length + depth`. Traps in transformers 5.x that this module
exists to avoid (each one is silently wrong, not an error):

- a 4D mask is passed through as-is; *eager* attention *adds* it to the scores,
  so a boolean mask there adds 0/1 instead of 0/-inf. We give eager an additive
  float mask and sdpa a boolean one (True = attend).
- without explicit `position_ids` the model numbers the tree positions
  consecutively (past + 0, 1, 2, ...), i.e. as one long sequence.
- `DynamicCache.crop` takes a negative count; and there is no keep-index
  method, so we compact by `index_select` on each layer's keys and values.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tree.lean import StaticKV
from tree.lean_model import lean_model, supports

if TYPE_CHECKING:  # imported where a cache is built: the offline commands never load it
    from transformers import DynamicCache, PreTrainedModel


def check_batch_one(input_ids: Tensor, who: str) -> None:
    """Refuse anything but one stream: input ids must be [1, n]."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"{who}: decoding runs at batch size 1 (one prompt per stream); "
            f"expected input ids of shape [1, n], got {tuple(input_ids.shape)}"
        )


def ancestor_matrix(parent: Tensor, max_depth: int) -> Tensor:
    """anc[i, j] = True when node j is node i or one of its ancestors. [P, P] bool.

    `parent` is [P] in pool order (-1 = child of the root). One tensor step per
    depth level (<= 8 by default), never one per node, and no host sync.
    """
    n = parent.shape[0]
    idx = torch.arange(n, device=parent.device)
    anc = torch.zeros(n, n, dtype=torch.bool, device=parent.device)
    anc[idx, idx] = True
    up = parent.long()  # [P] ancestor `step` levels up, -1 past the root
    for _ in range(max_depth - 1):
        live = up >= 0
        anc[idx, up.clamp(min=0)] |= live
        up = torch.where(live, parent.long()[up.clamp(min=0)], up)
    return anc


def to_attention_mask(visible: Tensor, dtype: torch.dtype, attn_implementation: str) -> Tensor:
    """A [1, 1, q, kv] mask from a [q, kv] visibility matrix, in the form the kernel needs."""
    if attn_implementation == "sdpa":
        return visible[None, None]
    if attn_implementation == "eager":
        # Additive: 0 where visible, the dtype's most negative finite value elsewhere
        # (finite, so a fully masked row would give uniform weights, never NaN).
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        return mask[None, None]
    raise ValueError(
        f"tree attention supports attn_implementation 'sdpa' or 'eager'. Got {attn_implementation!r} instead."
    )


def tree_visibility(n_context: int, tree_past: Tensor, tree_new: Tensor) -> Tensor:
    """Visibility of new tree positions over [context | earlier tree positions | new positions].

    n_context: cached positions every new position sees (committed tokens).
    tree_past: [q, n_past_tree] bool, which earlier cached tree positions each new one sees.
    tree_new:  [q, q] bool, which new positions each new one sees (ancestors and itself).
    Returns [q, n_context + n_past_tree + q] bool.
    """
    q = tree_new.shape[0]
    ctx = torch.ones(q, n_context, dtype=torch.bool, device=tree_new.device)
    return torch.cat([ctx, tree_past, tree_new], dim=1)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def cache_kwarg(model: PreTrainedModel) -> str:
    # transformers renamed `past_key_values` to `cache` (deprecated alias until
    # 5.40); pass whichever the installed model's forward declares, so neither
    # side emits the deprecation warning. Looked up once per model class (inspect took
    # about 22 us a call, on each of a round's nine forwards), unless this instance
    # replaced its forward (e.g. accelerate's hooks).
    if "forward" in vars(model):
        return _declared(model.forward)
    return _class_kwarg(type(model))


@functools.cache
def _class_kwarg(cls: type) -> str:
    return _declared(cls.forward)


def _declared(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


@torch.inference_mode()
def forward_tree(
    model: PreTrainedModel,
    input_ids: Tensor,
    position_ids: Tensor,
    visible: Tensor,
    cache: DynamicCache,
    logits_to_keep: int | Tensor = 0,
) -> Tensor:
    """One forward of `n` new positions under a tree mask; appends their KV to `cache`.

    input_ids, position_ids: [n]; visible: [n, cache_length + n] bool.
    Returns logits [n_kept, vocab] in the model's dtype.
    """
    check_batch_one(input_ids[None], "forward_tree")
    n = input_ids.shape[0]
    past = cache_length(cache)
    if visible.shape != (n, past + n):
        raise ValueError(
            f"forward_tree: visibility must be [n, cache_length + n] = [{n}, {past + n}]; "
            f"got {tuple(visible.shape)}"
        )
    if isinstance(cache, StaticKV):
        return lean_model(model).tree(input_ids, position_ids, visible, cache, logits_to_keep)
    impl = model.config._attn_implementation
    mask = to_attention_mask(visible, model.dtype, impl)
    out = model(
        input_ids=input_ids[None],
        position_ids=position_ids[None],
        attention_mask=mask,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **{cache_kwarg(model): cache},
    )
    return out.logits[0]  # [n_kept, vocab]


@torch.inference_mode()
def forward_chain(
    model: PreTrainedModel, input_ids: Tensor, cache: DynamicCache, logits_to_keep: int | Tensor = 0
) -> Tensor:
    """A causal forward of `n` consecutive tokens after the cache (prefill, pending tokens).

    Uses the same explicit-mask path as `forward_tree`, so the two agree on
    masking and positions by construction. Returns logits [n_kept, vocab].
    """
    n = input_ids.shape[0]
    past = cache_length(cache)
    causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
    visible = tree_visibility(past, causal[:, :0], causal)
    positions = torch.arange(past, past + n, device=input_ids.device)
    return forward_tree(model, input_ids, positions, visible, cache, logits_to_keep)


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty DynamicCache; refuses models whose cache would not be plain full attention."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise ValueError(
            f"{model.config.model_type}: sliding-window attention layers are not supported by the "
            "tree decoder (their caches cannot be compacted by index)"
        )
    return cache


def draft_cache(model: PreTrainedModel) -> DynamicCache | StaticKV:
    """A standalone drafter's cache: static (`tree.lean_model`) for a plain Llama, else a
    DynamicCache (`new_cache`)."""
    return lean_model(model).new_cache() if supports(model) else new_cache(model)


@torch.inference_mode()
def compact_cache(cache: DynamicCache, keep_prefix: int, keep: list[int]) -> None:
    """Keep cache positions [0, keep_prefix) followed by positions `keep` (ascending), drop the rest.

    Used after a round: the prefix is the committed context plus the root, `keep`
    the accepted path's tree positions. Copies only len(keep) entries per layer,
    not the whole context. (We slice instead of `DynamicCache.crop`, whose
    argument changed meaning across transformers versions: a negative count now.)
    """
    total = cache_length(cache)
    if any(k < keep_prefix or k >= total for k in keep) or sorted(keep) != list(keep):
        raise ValueError(
            f"compact_cache: kept positions must ascend within [{keep_prefix}, {total}); got {keep}"
        )
    if isinstance(cache, StaticKV):
        cache.compact(keep_prefix, keep)
        return
    n_keep = keep_prefix + len(keep)
    if keep:
        index = torch.tensor(keep, device=cache.layers[0].keys.device)
    for layer in cache.layers:
        if keep:
            # index_select copies first, so the in-place write cannot read its own output.
            layer.keys[..., keep_prefix:n_keep, :] = layer.keys.index_select(-2, index)
            layer.values[..., keep_prefix:n_keep, :] = layer.values.index_select(-2, index)
        layer.keys = layer.keys[..., :n_keep, :]
        layer.values = layer.values[..., :n_keep, :]
