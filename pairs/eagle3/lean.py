"""An EAGLE-3 head's forward on `tree.lean` layers over a static KV cache (drafting only).

The same arithmetic as `pairs.eagle3.head.Eagle3Head.forward` and `.logits`, with what a
drafting round would recompute at every level done once:

    embeddings  input_layernorm(e(token)) of every token, a table built once (a row-wise
                op, so a row of the table is the row the module computes), when it is small;
                a second one by draft id (logit column), so that drafted children are fed
                without mapping them to target ids first
    hidden      a child's `hidden_norm` of its parent's output is normed on the child's row
                (row-wise again: the row the parent's level would have given)
    layers      q/k/v one matmul, RoPE a column gather, gate/up one matmul, the roped rows
                summed into the cache (`tree.lean`)
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from pairs.eagle3.head import Eagle3Head
from tree.lean import LeanLayer, RopeTable, Slots, StaticKV, rms_norm
from tree.lean_model import STATIC_ROPE

# The normed-embedding table is kept up to this many elements (a pocket head's is 160 K;
# a full-size head's, vocabulary x width, would be gigabytes: its rows are normed per call)
TABLE_ELEMENTS = 1 << 24


def supports_head(head: Eagle3Head) -> bool:
    return (head.config._attn_implementation == "sdpa"
            and getattr(head.rotary_emb, "rope_type", None) in STATIC_ROPE
            and getattr(head.config, "hidden_act", "silu") == "silu")  # fmt: skip


class LeanHead:
    """The head's layers on fused weights (built once; the head's weights must not change)."""

    def __init__(self, head: Eagle3Head) -> None:
        first = head.layers[0]
        self.fuse_w = head.fc.weight.t()
        self.hn_w, self.hn_eps = first.hidden_norm.weight, first.hidden_norm.variance_epsilon
        self.in_w, self.in_eps = (
            first.input_layernorm.weight,
            first.input_layernorm.variance_epsilon,
        )
        self.before_residual = first.norm_before_residual
        self.layers = [LeanLayer(lay.self_attn, lay.mlp, lay.post_attention_layernorm)
                       for lay in head.layers]  # fmt: skip
        self.norms = [(lay.input_layernorm.weight, lay.input_layernorm.variance_epsilon)
                      for lay in head.layers[1:]]  # fmt: skip
        self.norm_w, self.norm_eps = head.norm.weight, head.norm.variance_epsilon
        lm = head.lm_head if head.lm_head is not None else head._shared[1]
        self.w_lm = lm.weight.t()
        table = head.embed_tokens if head.embed_tokens is not None else head._shared[0]
        self.embed_w = table.weight
        self.token_ids = head.token_ids  # draft id -> target id (None: the same ids)
        self.normed = self.normed_cols = None
        if self.embed_w.numel() <= TABLE_ELEMENTS:
            self.normed = rms_norm(self.embed_w.to(self.fuse_w.dtype), self.in_w, self.in_eps)
            self.normed_cols = (self.normed if self.token_ids is None
                                else self.normed.index_select(0, self.token_ids))  # fmt: skip
        lay = self.layers[0]
        dtype = self.fuse_w.dtype
        self.rope = RopeTable(head.rotary_emb, lay.heads, lay.kv_heads, lay.hd, dtype)
        self.shape = (len(self.layers), lay.heads, lay.kv_heads, lay.hd, dtype,
                      self.fuse_w.device)  # fmt: skip

    def new_cache(self) -> StaticKV:
        return StaticKV(*self.shape)

    def embeds(self, ids: Tensor, columns: bool = False) -> Tensor:
        """input_layernorm(e(ids)) [n, H]; columns: `ids` are draft ids (logit columns)."""
        table = self.normed_cols if columns else self.normed
        if table is not None:
            return table.index_select(0, ids)
        if columns and self.token_ids is not None:
            ids = self.token_ids.index_select(0, ids)
        e = torch.nn.functional.embedding(ids, self.embed_w).to(self.fuse_w.dtype)
        return rms_norm(e, self.in_w, self.in_eps)

    def forward(self, hidden: Tensor, normed: Tensor, ids: Tensor, rope: Tensor,
                slots: list[Slots], mask: Tensor, columns: bool = False) -> Tensor:  # fmt: skip
        """Pre-norm outputs [n, H] of hidden [n, H] (`normed`: its hidden_norm) and ids [n]
        (draft ids with `columns`), at the slots `slots` names per layer
        (`tree.lean.LeanLayer.forward`)."""
        x = torch.cat([self.embeds(ids, columns), normed], -1)
        h = self.layers[0].forward(x, normed if self.before_residual else hidden, rope,
                                   slots[0], mask)  # fmt: skip
        for (w, eps), layer, sl in zip(self.norms, self.layers[1:], slots[1:], strict=True):
            h = layer.forward(rms_norm(h, w, eps), h, rope, sl, mask)
        return h

    def outputs(self, h: Tensor) -> Tensor:
        """The draft rows [n, V'] (logits) of pre-norm outputs."""
        return torch.mm(rms_norm(h, self.norm_w, self.norm_eps), self.w_lm)

    def hidden_norm(self, g: Tensor) -> Tensor:
        """What a node takes as its normed hidden: hidden_norm of its parent's output."""
        return rms_norm(g, self.hn_w, self.hn_eps)


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_head(head: Eagle3Head) -> LeanHead:
    """The head's `LeanHead`, built on first use."""
    lean = _LEAN.get(head)
    if lean is None:
        with torch.inference_mode():
            lean = _LEAN[head] = LeanHead(head)
    return lean
