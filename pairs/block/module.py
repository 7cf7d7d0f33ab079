"""A DFlash-style block drafter as a torch module (z-lab/dflash `DFlashDraftModel`, read at
commit 44947fbf71114e241c96de194f4b382b5dd330d0, where `dflash/model.py` was last changed by
7d2ea1e; this is our own code of that layout).

    context  : c = hidden_norm(fc([h_1 | ... | h_k]))   the target's hidden states of the
               committed positions, leaving target layers `target_layer_ids` (one shared
               projection); each layer's k_proj / v_proj turn c into that layer's context K/V
    block    : x = e([root, mask, ..., mask])           the target's own embedding of the root
               (the bonus token) and block_size - 1 mask placeholders, at positions r .. r+bs-1
    layer    : pre-norm Qwen3 layer whose queries are the block's and whose keys and values are
               [context ; block], with no mask: every block position sees the whole context and
               the whole block (DFlash's `is_causal: false`)
    output   : norm(h); the target's lm_head gives the logits. Row j >= 1 is the drafter's
               marginal for the token at position r + j, conditioned on the context and the
               root only, never on the other draft tokens.

Context mixing `per_layer` (DFlare's, the DCore recipe's context; `dflash_config.context_mixing`):
instead of one shared `fc`, draft layer i mixes the k normed target states with its own
weights alpha(i) = softmax(W_fuse[i, :]) (`fuse`, [layers, k], zeros at start: the mean),
and its own projections `context_k_proj`, `context_v_proj` turn the mixture into that
layer's context keys and values. The paper gives the mixture and "per-draft-layer
projections"; that they map to each layer's K and V is our reading of its parameter
table (the fusion's size is 2 x layers x kv width x the target's width at both targets).

The parameter names are the reference's (`fc`, `hidden_norm`, `layers.{i}.self_attn.q_proj`,
..., `norm`), so a released checkpoint's state dict loads as it is. Attention projections,
q/k norms, MLP, norms and rotary embeddings are transformers' Qwen3 modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

ContextKV = list[tuple[Tensor, Tensor]]  # per layer: keys and values [kv_heads, n, head_dim]


class BlockLayer(nn.Module):
    """One decoder layer: block queries over [context ; block] keys and values."""

    def __init__(self, config: Qwen3Config, index: int, own_context: bool = False) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx=index)
        self.mlp = Qwen3MLP(config)
        h = config.hidden_size
        self.input_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.own_context = own_context
        if own_context:  # per_layer mixing: this layer's own context projections
            kv = config.num_key_value_heads * self.self_attn.head_dim
            self.context_k_proj = nn.Linear(h, kv, bias=False)
            self.context_v_proj = nn.Linear(h, kv, bias=False)

    def _heads(self, proj: nn.Linear, x: Tensor, norm: nn.Module | None) -> Tensor:
        a = self.self_attn
        out = proj(x).view(x.shape[0], -1, a.head_dim)
        return (norm(out) if norm is not None else out).transpose(0, 1)  # [heads, n, hd]

    def context_kv(self, context: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """This layer's keys and values of projected context rows [n, H] at their positions."""
        a = self.self_attn
        own = self.own_context
        k = self._heads(self.context_k_proj if own else a.k_proj, context, a.k_norm)
        cos, sin = rope
        k = k * cos[None] + rotate_half(k) * sin[None]  # keys only: no query at the context
        return k, self._heads(self.context_v_proj if own else a.v_proj, context, None)

    def forward(self, hidden: Tensor, rope: tuple[Tensor, Tensor], ctx: tuple[Tensor, Tensor],
                mask: Tensor | None = None) -> Tensor:  # fmt: skip
        a = self.self_attn
        x = self.input_layernorm(hidden)
        q = self._heads(a.q_proj, x, a.q_norm)
        k = self._heads(a.k_proj, x, a.k_norm)
        v = self._heads(a.v_proj, x, None)
        q, k = apply_rotary_pos_emb(q, k, *rope, unsqueeze_dim=0)
        k, v = torch.cat([ctx[0], k], dim=1), torch.cat([ctx[1], v], dim=1)
        groups = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
        # No mask when decoding: the block sees the whole context and itself both ways.
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                             scale=a.scaling)[0]  # fmt: skip
        h = hidden + a.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockDrafterModule(nn.Module):
    """fc + hidden_norm over the target's states (or per-layer mixing), decoder layers, norm
    (see the module doc)."""

    def __init__(self, config: Qwen3Config, n_target_layers: int, mixing: str = "shared") -> None:
        super().__init__()
        self.config, self.mixing, self.n_target_layers = config, mixing, n_target_layers
        h, n = config.hidden_size, config.num_hidden_layers
        per_layer = mixing == "per_layer"
        self.layers = nn.ModuleList(BlockLayer(config, i, per_layer) for i in range(n))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        if per_layer:
            self.fuse = nn.Parameter(torch.zeros(n, n_target_layers))  # W_fuse
        else:
            self.fc = nn.Linear(n_target_layers * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)

    def _rope(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self.rotary_emb(x[None], positions[None])
        return cos[0], sin[0]  # [n, head_dim]

    def context(self, features: Tensor, positions: Tensor) -> ContextKV:
        """Every layer's keys and values of target states `features` [n, k*H] at `positions`."""
        if self.mixing == "per_layer":  # each layer its own mixture of the normed states
            states = self.hidden_norm(features.view(features.shape[0], self.n_target_layers, -1))
            alpha = self.fuse.softmax(-1).to(states.dtype)  # [layers, k]
            rope = self._rope(states[:, 0], positions)
            return [layer.context_kv(torch.einsum("nkh,k->nh", states, a), rope)
                    for layer, a in zip(self.layers, alpha, strict=True)]  # fmt: skip
        c = self.hidden_norm(self.fc(features))
        rope = self._rope(c, positions)
        return [layer.context_kv(c, rope) for layer in self.layers]

    def forward(self, embeds: Tensor, positions: Tensor, ctx: ContextKV,
                mask: Tensor | None = None) -> Tensor:  # fmt: skip
        """The block's final hidden states [n, H] (normed) from its embeddings [n, H].

        `mask` [n, context + n] bool (True: attends), for training several blocks of one
        window in one forward (`recipes.pocket.block`); None: every position sees all.
        """
        rope = self._rope(embeds, positions)
        h = embeds
        for layer, kv in zip(self.layers, ctx, strict=True):
            h = layer(h, rope, kv, mask)
        return self.norm(h)
