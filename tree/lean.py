"""Lean forwards of Llama-shaped layers for drafting: fused weights and a static KV cache.

A drafting round runs one small forward per depth level; at pocket sizes each costs what
its ops dispatch and its matmuls compute. So here a layer's q, k and v are one matmul and
gate and up one; RoPE's rotate-half is a column gather of that product (its sign folded
into the sin rows of a table built once per model), and the roped [q | k | v] rows are
summed straight into the cache (`StaticKV`: token-major, a slot's row holds its q, k and
v), whose query, key and value views the attention reads. The attention mask is additive
(what sdpa makes of a boolean one). Each step is the transformers modules' own arithmetic
in their order (RMSNorm, RoPE, sdpa, SiLU MLP), so outputs match theirs (tests compare).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# (rows [n, C], queries, keys, values) of one layer in one forward (`StaticKV.slots`)
Slots = tuple[Tensor, Tensor, Tensor, Tensor]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' LlamaRMSNorm: in float32 `torch.rms_norm`, whose composite is that
    arithmetic (x * rsqrt(mean(x^2) + eps) * w) in one dispatched call; else op for op."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return torch.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotation(heads: int, kv_heads: int, hd: int) -> tuple[Tensor, Tensor]:
    """Over a layer's [q | k | v] columns: the column gather [identity | rotate-half source]
    (v: identity) and rotate_half's signs (-1 on each head's first half, v: 0)."""
    half = hd // 2
    within = torch.cat([torch.arange(half, hd), torch.arange(half)])  # rotate_half's sources
    qk = heads + kv_heads
    src = torch.cat([(within + h * hd) for h in range(qk)]
                    + [torch.arange(qk * hd, (qk + kv_heads) * hd)])  # fmt: skip
    sign = torch.cat([-torch.ones(half), torch.ones(half)]).repeat(qk)
    c = (qk + kv_heads) * hd
    return torch.cat([torch.arange(c), src]), torch.cat([sign, torch.zeros(kv_heads * hd)])


class RopeTable:
    """cos/sin rows of every position [L, 2, C], laid out over a layer's [q | k | v] columns
    (the value's as cos 1, sin 0; rotate_half's signs in the sin row): with `both` a layer's
    [qkv | qkv gathered by `LeanLayer.rot_idx`], `(both.view(n, 2, C) * rows).sum(1)` is
    q * cos + rotate_half(q) * sin (and k's), as transformers computes it, v unchanged."""

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
        _, sign = _rotation(heads, kv_heads, hd)
        one = torch.ones(n, kv_heads * hd)
        c = torch.cat([cos.repeat(1, qk), one.to(cos)], -1)
        # -sin exactly: (-x) * s and x * (-s) round alike, so the signs can sit here
        s = torch.cat([sin.repeat(1, qk), one.to(sin)], -1) * sign.to(sin)
        return torch.stack([c, s], 1)


class LeanLayer:
    """One Llama decoder layer (attention + SiLU MLP) on fused weights; `forward` takes the
    attention input already normed (layer 0 of an EAGLE-3 head reads a wider one)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, post_norm: nn.Module) -> None:
        cfg = attn.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd, self.scaling = attn.head_dim, attn.scaling
        q, k, v = (getattr(attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        # a transposed view: mm as F.linear does
        self.w_qkv = torch.cat([q.weight, k.weight, v.weight]).t()
        self.b_qkv = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
        self.rot_idx = _rotation(self.heads, self.kv_heads, self.hd)[0].to(q.weight.device)
        self.w_o, self.b_o = attn.o_proj.weight.t(), attn.o_proj.bias
        self.w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()
        self.w_down, self.inter = mlp.down_proj.weight.t(), mlp.gate_proj.out_features
        self.post_w, self.post_eps = post_norm.weight, post_norm.variance_epsilon
        self.dq = self.heads * self.hd
        self.gqa = self.heads != self.kv_heads

    def forward(self, x: Tensor, res: Tensor, rope: Tensor, slots: Slots, mask: Tensor) -> Tensor:
        """x: [n, in] normed input; res: [n, H] residual; rope: [n or 1, 2, C] table rows;
        slots: this layer's cache rows [n, C] the forward writes (its slots) and its views of
        them and of the attended slots (`StaticKV.slots`); mask: additive [n, S]."""
        rows, q, k, v = slots
        n = x.shape[0]
        qkv = torch.mm(x, self.w_qkv) if self.b_qkv is None else torch.addmm(
            self.b_qkv, x, self.w_qkv)  # fmt: skip
        both = qkv.index_select(1, self.rot_idx)  # [qkv | rotate-half sources]
        torch.sum(both.view(n, 2, -1) * rope, 1, out=rows)  # roped [q | k | v], cached
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling,
                                           enable_gqa=self.gqa)  # fmt: skip
        o = o.transpose(1, 2).reshape(n, self.dq)
        o = torch.mm(o, self.w_o) if self.b_o is None else torch.addmm(self.b_o, o, self.w_o)
        h = res + o
        gate, up = torch.mm(rms_norm(h, self.post_w, self.post_eps), self.w_gu).split(
            self.inter, -1)  # fmt: skip
        return h + torch.mm(F.silu(gate) * up, self.w_down)


class StaticKV:
    """A preallocated cache of every layer, token-major [layers, capacity, C]: a slot's row is
    its roped [q | k | v] (the q part is scratch, the layer's queries), filled to `length`;
    past it the slots hold stale finite values (zeros at first), which a mask hides. Per
    layer, views [1, heads, capacity, hd] of its queries, keys and values (`q`, `k`, `v`)."""

    def __init__(self, layers: int, heads: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:  # fmt: skip
        self.split = (heads, kv_heads, head_dim)
        width = (heads + 2 * kv_heads) * head_dim
        self._use(torch.zeros(layers, capacity, width, dtype=dtype, device=device))
        self.length = 0

    def _use(self, buf: Tensor) -> None:
        heads, kv_heads, hd = self.split
        self.buf = buf
        self.rows = list(buf.unbind(0))  # [capacity, C] per layer
        per = buf.view(*buf.shape[:2], heads + 2 * kv_heads, hd).transpose(1, 2)[:, None]
        self.q = list(per[:, :, :heads].unbind(0))
        self.k = list(per[:, :, heads : heads + kv_heads].unbind(0))
        self.v = list(per[:, :, heads + kv_heads :].unbind(0))

    def get_seq_length(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.buf.shape[1]

    def reserve(self, n: int) -> None:
        """Room for `n` positions in all (a larger buffer, the filled part copied)."""
        if n <= self.capacity:
            return
        b = self.buf
        grown = b.new_zeros(b.shape[0], max(n, 2 * self.capacity), b.shape[2])
        grown[:, : self.length] = b[:, : self.length]
        self._use(grown)

    def slots(self, at: int, n: int) -> list[Slots]:
        """Per layer, what a forward of `n` positions at slots [at, at + n) attending to slots
        [0, at + n) takes: its rows, queries, and the keys and values it attends to."""
        end = at + n
        return [(r.narrow(0, at, n), q.narrow(2, at, n), k.narrow(2, 0, end), v.narrow(2, 0, end))
                for r, q, k, v in zip(self.rows, self.q, self.k, self.v, strict=True)]  # fmt: skip

    def compact(self, keep_prefix: int, keep: list[int]) -> None:
        """Slots [0, keep_prefix) then `keep` (ascending, past the prefix); the rest dropped."""
        if keep:
            idx = torch.tensor(keep, device=self.buf.device)
            n = keep_prefix + len(keep)
            # index_select copies first, so the write cannot read its own output
            self.buf[:, keep_prefix:n] = self.buf.index_select(1, idx)
        self.length = keep_prefix + len(keep)


class RoundSlots:
    """One drafting round's segments of a `StaticKV`: slots [start, start + sum(sizes)) in
    consecutive runs (a chain fed first, then the levels), every layer's rows and queries
    split once for the round. `segment(i, end)` adds the keys and values of slots [0, end):
    a forward attends to exactly the slots fed so far, never to the round's later (masked)
    ones, so the sdpa kernel's blocks are those of a cache holding just them, its sums bit
    for bit."""

    def __init__(self, cache: StaticKV, start: int, sizes: list[int]) -> None:
        cache.reserve(start + sum(sizes))
        bounds = [start, *sizes, cache.capacity - start - sum(sizes)]
        self.cache = cache
        self.rows = [r.split(bounds) for r in cache.rows]
        self.q = [q.split(bounds, 2) for q in cache.q]

    def segment(self, i: int, end: int) -> list[Slots]:
        c = self.cache
        return [(r[i + 1], q[i + 1], k.narrow(2, 0, end), v.narrow(2, 0, end))
                for r, q, k, v in zip(self.rows, self.q, c.k, c.v, strict=True)]  # fmt: skip


def additive_mask(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """[q, kv] additive mask (0 / -inf) of a boolean visibility, as sdpa builds it."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    return torch.where(visible, zero, float("-inf"))


def chain_mask(past: int, n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive mask [n, past + n] of `n` consecutive positions after `past` cached ones:
    row i sees slots [0, past + i] (`additive_mask` of that visibility, in two ops)."""
    full = torch.full((n, past + n), float("-inf"), dtype=dtype, device=device)
    return full.triu(past + 1)
