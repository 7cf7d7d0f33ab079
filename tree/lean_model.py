"""A standalone Llama drafter's forward on `tree.lean` layers over a static KV cache.

`tree.attention.draft_cache(model)` gives a drafter its cache: a `tree.lean.StaticKV` when the model is a
plain Llama (`supports`), whose forwards then run here (`tree.attention.forward_tree`
dispatches on the cache), else transformers' DynamicCache and the model's own forward.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from tree.lean import LeanLayer, RopeTable, Slots, StaticKV, additive_mask, chain_mask, rms_norm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# RoPE kinds whose rows depend on the position alone (a table holds them)
STATIC_ROPE = {"default", "linear", "llama3"}


def supports(model: PreTrainedModel) -> bool:
    """A plain Llama causal LM with sdpa attention: what `LeanCausalLM` reproduces."""
    cfg = model.config
    inner = getattr(model, "model", None)
    return (
        type(model).__name__ == "LlamaForCausalLM"
        and cfg._attn_implementation == "sdpa"
        and getattr(cfg, "hidden_act", None) == "silu"
        and getattr(cfg, "pretraining_tp", 1) == 1
        and getattr(getattr(inner, "rotary_emb", None), "rope_type", None) in STATIC_ROPE
        and getattr(model.lm_head, "bias", None) is None
        and "forward" not in vars(model)  # no hooks (accelerate's offloading) around it
    )


class LeanCausalLM:
    """The model's layers on fused weights (built once; the model's weights must not change)."""

    def __init__(self, model: PreTrainedModel) -> None:
        inner, cfg = model.model, model.config
        self.embed = inner.embed_tokens.weight
        self.norms = [(lay.input_layernorm.weight, lay.input_layernorm.variance_epsilon)
                      for lay in inner.layers]  # fmt: skip
        self.layers = [LeanLayer(lay.self_attn, lay.mlp, lay.post_attention_layernorm)
                       for lay in inner.layers]  # fmt: skip
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.w_lm = model.lm_head.weight.t()
        lay = self.layers[0]
        self.rope = RopeTable(inner.rotary_emb, lay.heads, lay.kv_heads, lay.hd, model.dtype)
        self.shape = (cfg.num_hidden_layers, lay.heads, lay.kv_heads, lay.hd, model.dtype,
                      model.device)  # fmt: skip

    def new_cache(self) -> StaticKV:
        return StaticKV(*self.shape)

    def forward(self, ids: Tensor, rope: Tensor, slots: list[Slots], mask: Tensor,
                keep: int | Tensor = 0) -> Tensor:  # fmt: skip
        """Logits of `ids` [n] at the slots `slots` names, per layer (`LeanLayer.forward`);
        keep: the last `keep` rows (0: all) or the rows an index tensor names."""
        h = F.embedding(ids, self.embed)
        for (w, eps), layer, sl in zip(self.norms, self.layers, slots, strict=True):
            h = layer.forward(rms_norm(h, w, eps), h, rope, sl, mask)
        if isinstance(keep, Tensor):
            h = h.index_select(0, keep)
        elif keep:
            h = h[-keep:]
        return torch.mm(rms_norm(h, self.norm_w, self.norm_eps), self.w_lm)

    def tree(self, ids: Tensor, positions: Tensor, visible: Tensor, cache: StaticKV,
             keep: int | Tensor = 0) -> Tensor:  # fmt: skip
        """`tree.attention.forward_tree` on the cache: `visible` [n, length + n] bool."""
        n, past = ids.shape[0], cache.length
        cache.reserve(past + n)
        rope = self.rope.at(past + n + 1).index_select(0, positions)
        mask = additive_mask(visible, self.shape[4])
        out = self.forward(ids, rope, cache.slots(past, n), mask, keep)
        cache.length = past + n
        return out

    def chain(self, ids: Tensor, slots: list[Slots], past: int, keep: int = 0) -> Tensor:
        """A causal forward of `ids` [n] at positions (and slots) [past, past + n), which
        `slots` names (a `tree.lean.RoundSlots` segment); the cache's length is the caller's."""
        n = ids.shape[0]
        rope = self.rope.at(past + n)[past : past + n]
        mask = chain_mask(past, n, self.shape[4], ids.device)
        return self.forward(ids, rope, slots, mask, keep)


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_model(model: PreTrainedModel) -> LeanCausalLM:
    """The model's `LeanCausalLM`, built on first use."""
    lean = _LEAN.get(model)
    if lean is None:
        with torch.inference_mode():
            lean = _LEAN[model] = LeanCausalLM(model)
    return lean
