"""Lean forwards of Llama-shaped layers for drafting: fused weights and a static KV cache.

A drafting round runs one small forward per depth level; at pocket sizes each costs what
its ops dispatch, not what they compute. So here a layer's q, k, v and their RoPE
rotate-half (folded into extra weight rows, the value's rows paired with zeros) are one
matmul, gate and up are one, the RoPE rows come from a table built once per model, the
attention mask is additive (what sdpa makes of a boolean one) and keys and values go to a
preallocated cache by slot ranges. Each step is the transformers modules' own arithmetic
in their order (RMSNorm, RoPE, sdpa, SiLU MLP), so outputs match theirs (tests compare).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm, op for op (float32 skips the round trips)."""
    dtype = x.dtype
    h = x if dtype == torch.float32 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h if dtype == torch.float32 else h.to(dtype))


def _rotated_rows(w: Tensor, heads: int) -> Tensor:
    """Rows of W whose product is rotate_half(W x) per head: [-W2; W1] of each head."""
    hd = w.shape[0] // heads
    per = w.view(heads, 2, hd // 2, *w.shape[1:])
    return torch.cat([-per[:, 1:], per[:, :1]], dim=1).reshape(w.shape)


class RopeTable:
    """cos/sin rows of every position [L, 2, C], laid out over a layer's [q | k | v] columns
    (the value's as cos 1, sin 0): `(qkv.view(n, 2, C) * rows).sum(1)` is RoPE applied."""

    def __init__(self, rotary: nn.Module, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.rotary, self.split, self.dtype = rotary, (heads, kv_heads, head_dim), dtype
        self.rows = torch.empty(0)

    def at(self, n: int) -> Tensor:
        """The table covering positions [0, n) at least (grown by doubling)."""
        if self.rows.shape[0] < n:
            self.rows = self._build(max(n, 2 * self.rows.shape[0], 256))
        return self.rows

    @torch.inference_mode()
    def _build(self, n: int) -> Tensor:
        heads, kv_heads, hd = self.split
        dev = next(self.rotary.buffers()).device
        pos = torch.arange(n, device=dev)[None]
        cos, sin = self.rotary(torch.empty(0, device=dev, dtype=self.dtype), pos)
        cos, sin = cos[0], sin[0]  # [n, hd]
        qk = heads + kv_heads
        one, zero = torch.ones(n, kv_heads * hd), torch.zeros(n, kv_heads * hd)
        c = torch.cat([cos.repeat(1, qk), one.to(cos)], -1)
        s = torch.cat([sin.repeat(1, qk), zero.to(sin)], -1)
        return torch.stack([c, s], 1)


class LeanLayer:
    """One Llama decoder layer (attention + SiLU MLP) on fused weights; `forward` takes the
    attention input already normed (layer 0 of an EAGLE-3 head reads a wider one)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, post_norm: nn.Module) -> None:
        cfg = attn.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd, self.scaling = attn.head_dim, attn.scaling
        q, k, v = (getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        zero_v = torch.zeros_like(v.weight)
        rows = [q.weight, k.weight, v.weight, _rotated_rows(q.weight, self.heads),
                _rotated_rows(k.weight, self.kv_heads), zero_v]  # fmt: skip
        self.w_qkv = torch.cat(rows).t()  # a transposed view: mm as F.linear does
        self.b_qkv = None
        if q.bias is not None:
            b = [q.bias, k.bias, v.bias, _rotated_rows(q.bias, self.heads),
                 _rotated_rows(k.bias, self.kv_heads), torch.zeros_like(v.bias)]  # fmt: skip
            self.b_qkv = torch.cat(b)
        self.w_o, self.b_o = attn.o_proj.weight.t(), attn.o_proj.bias
        self.w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
        self.w_down, self.inter = mlp.down_proj.weight.t(), mlp.gate_proj.out_features
        self.post_w, self.post_eps = post_norm.weight, post_norm.variance_epsilon
        self.dq = self.heads * self.hd
        self.gqa = self.heads != self.kv_heads

    def forward(self, x: Tensor, res: Tensor, rope: Tensor, kv: Tensor, at: int,
                keys: tuple[Tensor, Tensor], mask: Tensor) -> Tensor:  # fmt: skip
        """x: [n, in] normed input; res: [n, H] residual; rope: [n or 1, 2, C] table rows;
        kv: this layer's cache [2, kv heads, capacity, hd], written at slots [at, at + n);
        keys: its [1, kv heads, S, hd] key and value views; mask: additive [n, S]."""
        n = x.shape[0]
        qkv = torch.mm(x, self.w_qkv) if self.b_qkv is None else torch.addmm(
            self.b_qkv, x, self.w_qkv)  # fmt: skip
        roped = (qkv.view(n, 2, -1) * rope).sum(1)  # [q | k | v]
        q = roped[:, : self.dq].view(1, n, self.heads, self.hd).transpose(1, 2)
        kv[:, :, at : at + n].copy_(
            roped[:, self.dq :].view(n, 2, self.kv_heads, self.hd).permute(1, 2, 0, 3)
        )
        o = F.scaled_dot_product_attention(q, keys[0], keys[1], attn_mask=mask,
                                           scale=self.scaling, enable_gqa=self.gqa)  # fmt: skip
        o = o.transpose(1, 2).reshape(n, self.dq)
        o = torch.mm(o, self.w_o) if self.b_o is None else torch.addmm(self.b_o, o, self.w_o)
        h = res + o
        gate, up = torch.mm(rms_norm(h, self.post_w, self.post_eps), self.w_gu).split(
            self.inter, -1)  # fmt: skip
        return h + torch.mm(F.silu(gate) * up, self.w_down)


class StaticKV:
    """A preallocated KV cache of every layer, [layers, 2, kv heads, capacity, hd], filled
    to `length`; past it the slots hold stale finite values (zeros at first), which a mask
    hides. Tree nodes are written in slot ranges after the context (`LeanLayer.forward`)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, capacity: int = 256) -> None:  # fmt: skip
        self.buf = torch.zeros(layers, 2, kv_heads, capacity, head_dim, dtype=dtype,
                               device=device)  # fmt: skip
        self.layers = list(self.buf.unbind(0))
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.buf.shape[3]

    def reserve(self, n: int) -> None:
        """Room for `n` positions in all (a larger buffer, the filled part copied)."""
        if n <= self.capacity:
            return
        grown = self.buf.new_zeros(*self.buf.shape[:3], max(n, 2 * self.capacity),
                                   self.buf.shape[4])  # fmt: skip
        grown[:, :, :, : self.length] = self.buf[:, :, :, : self.length]
        self.buf, self.layers = grown, list(grown.unbind(0))

    def keys(self, n: int | None = None) -> list[tuple[Tensor, Tensor]]:
        """Per layer, the [1, kv heads, n, hd] views of keys and values of slots [0, n)
        (None: of every slot, for `narrow_keys`)."""
        if n is None:
            return [(kv[:1], kv[1:]) for kv in self.layers]
        return [(kv[:1, :, :n], kv[1:, :, :n]) for kv in self.layers]

    def compact(self, keep_prefix: int, keep: list[int]) -> None:
        """Slots [0, keep_prefix) then `keep` (ascending, past the prefix); the rest dropped."""
        if keep:
            idx = torch.tensor(keep, device=self.buf.device)
            n = keep_prefix + len(keep)
            # index_select copies first, so the write cannot read its own output
            self.buf[:, :, :, keep_prefix:n] = self.buf.index_select(3, idx)
        self.length = keep_prefix + len(keep)


def narrow_keys(keys: list[tuple[Tensor, Tensor]], n: int) -> list[tuple[Tensor, Tensor]]:
    """`StaticKV.keys(n)` from `keys()` views: the slots a forward attends to. A level
    attends to exactly the slots fed so far, never to the round's later (masked) ones: the
    sdpa kernel's blocks then are those of a cache holding just them, its sums bit for bit."""
    return [(k.narrow(2, 0, n), v.narrow(2, 0, n)) for k, v in keys]


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """[q, kv] additive mask (0 / -inf) of a boolean visibility, as sdpa builds it."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, float("-inf"))
