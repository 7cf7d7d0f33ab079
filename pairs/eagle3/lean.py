"""An EAGLE-3 head's forward on `tree.lean` layers over a static KV cache (drafting only).

The same arithmetic as `pairs.eagle3.head.Eagle3Head.forward` and `.logits`, with what a
drafting round would recompute at every level done once:

    embeddings  input_layernorm(e(token)) of every token, a table built once (a row-wise
                op, so a row of the table is the row the module computes), when it is small
    outputs     `norm` (for the logits) and the next level's `hidden_norm` of one output
                share its RMS factor when their epsilons agree
    layers      q/k/v + RoPE one matmul, gate/up one, cache writes by slot range
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from pairs.eagle3.head import Eagle3Head
from tree.lean import LeanLayer, RopeTable, StaticKV, rms_norm
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
        self.normed = None
        if self.embed_w.numel() <= TABLE_ELEMENTS:
            self.normed = rms_norm(self.embed_w.to(self.fuse_w.dtype), self.in_w, self.in_eps)
        lay = self.layers[0]
        dtype = self.fuse_w.dtype
        self.rope = RopeTable(head.rotary_emb, lay.heads, lay.kv_heads, lay.hd, dtype)
        self.shape = (len(self.layers), lay.kv_heads, lay.hd, dtype, self.fuse_w.device)

    def new_cache(self) -> StaticKV:
        return StaticKV(*self.shape)

    def embeds(self, ids: Tensor) -> Tensor:
        """input_layernorm(e(ids)) [n, H]."""
        if self.normed is not None:
            return self.normed.index_select(0, ids)
        e = torch.nn.functional.embedding(ids, self.embed_w).to(self.fuse_w.dtype)
        return rms_norm(e, self.in_w, self.in_eps)

    def forward(self, hidden: Tensor, normed: Tensor, ids: Tensor, rope: Tensor,
                cache: StaticKV, at: int, keys: list[tuple[Tensor, Tensor]], mask: Tensor,
                ) -> Tensor:  # fmt: skip
        """Pre-norm outputs [n, H] of hidden [n, H] (`normed`: its hidden_norm) and ids [n],
        written at slots [at, at + n) (`tree.lean.LeanLayer.forward`)."""
        x = torch.cat([self.embeds(ids), normed], -1)
        h = self.layers[0].forward(x, normed if self.before_residual else hidden, rope,
                                   cache.layers[0], at, keys[0], mask)  # fmt: skip
        for (w, eps), layer, kv, kvs in zip(self.norms, self.layers[1:], cache.layers[1:],
                                            keys[1:], strict=True):  # fmt: skip
            h = layer.forward(rms_norm(h, w, eps), h, rope, kv, at, kvs, mask)
        return h

    def outputs(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """(logits [n, V'], hidden_norm(h) [n, H]) of pre-norm outputs: the draft rows, and
        what a child of each takes as its normed hidden."""
        if self.norm_eps == self.hn_eps and h.dtype == torch.float32:
            y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            return torch.mm(self.norm_w * y, self.w_lm), self.hn_w * y
        normed = rms_norm(h, self.norm_w, self.norm_eps)
        return torch.mm(normed, self.w_lm), rms_norm(h, self.hn_w, self.hn_eps)

    def hidden_norm(self, g: Tensor) -> Tensor:
        return rms_norm(g, self.hn_w, self.hn_eps)


_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_head(head: Eagle3Head) -> LeanHead:
    """The head's `LeanHead`, built on first use."""
    lean = _LEAN.get(head)
    if lean is None:
        with torch.inference_mode():
            lean = _LEAN[head] = LeanHead(head)
    return lean
