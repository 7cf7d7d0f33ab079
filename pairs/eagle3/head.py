"""The EAGLE-3 head as a torch module (one decoder layer by default; EAGLE-3 paper, SafeAILab/EAGLE).

    fuse     : g = fc([a_1 | ... | a_k])        the target's aux hidden states -> head width
    layer 0  : x = [input_layernorm(e(token)) | hidden_norm(g)]   (2 x width: q/k/v read both)
               h = g + attn(x);  h = h + mlp(post_attention_layernorm(h))
               (norm_before_residual: the residual is hidden_norm(g) instead of g)
    layer i>0: a plain pre-norm Llama decoder layer on h (vLLM's multi-layer heads)
    output   : h (pre-norm) feeds the next depth as its hidden; logits = lm_head(norm(h))
               over the draft vocabulary; draft id j is target id `token_ids[j]` (d2t)

Position j of the head holds the pair (target feature at position j, token j + 1), so its
output predicts token j + 2; a drafted node at depth d below a root pair at position r sits
at r + d and takes its parent's output h as its hidden (`pairs.eagle3.pool`).

Attention, MLP, norms and rotary embeddings are transformers' Llama modules (RoPE scaling
types, sdpa/eager dispatch and the KV cache come with them); only q/k/v of layer 0 are
widened. The embedding and lm_head may be the target's own (shared, not copied).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)


class Eagle3Layer(nn.Module):
    """One decoder layer of the head; layer 0 reads [embedding | hidden] (see module doc)."""

    def __init__(self, config: LlamaConfig, index: int, norm_before_residual: bool) -> None:
        super().__init__()
        h, self.first, self.norm_before_residual = (
            config.hidden_size,
            index == 0,
            norm_before_residual,
        )
        self.self_attn = LlamaAttention(config, layer_idx=index)
        if self.first:
            for name in ("q_proj", "k_proj", "v_proj"):
                out = getattr(self.self_attn, name).out_features
                setattr(self.self_attn, name, nn.Linear(2 * h, out, bias=config.attention_bias))
            self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden: Tensor,
        embeds: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        cache: DynamicCache | None,
    ) -> Tensor:
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        # Positional cache argument: its keyword changed name across transformers versions.
        attn, _ = self.self_attn(x, rope, mask, cache)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc + decoder layer(s) + norm + draft lm_head; embedding / lm_head may be the target's.

    `shared_embed` / `shared_lm_head` are the target's modules, used when the checkpoint
    has no `embed_tokens.weight` / `lm_head.weight`; they are held outside the module tree,
    so `state_dict()` holds only the head's own tensors.
    """

    def __init__(
        self,
        config: LlamaConfig,
        n_aux: int,
        target_hidden: int,
        draft_vocab: int,
        norm_before_residual: bool = False,
        own_embed: bool = True,
        own_lm_head: bool = True,
        token_ids: Tensor | None = None,
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.config, self.n_aux, self.draft_vocab = config, n_aux, draft_vocab
        self.fc = nn.Linear(n_aux * target_hidden, h, bias=False)
        self.layers = nn.ModuleList(
            Eagle3Layer(config, i, norm_before_residual) for i in range(config.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if own_embed else None
        self.lm_head = nn.Linear(h, draft_vocab, bias=False) if own_lm_head else None
        self._shared: tuple[nn.Module | None, nn.Module | None] = (None, None)
        # Draft id -> target id (d2t applied); None: the draft vocabulary is the target's.
        self.register_buffer("token_ids", token_ids, persistent=False)

    def share(self, embed: nn.Module | None, lm_head: nn.Module | None) -> None:
        """Use the target's embedding / lm_head where the head has none of its own."""
        self._shared = (embed, lm_head)

    def embed(self, ids: Tensor) -> Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._shared[0]
        return table(ids)

    def fuse(self, features: Tensor) -> Tensor:
        """[..., n_aux * target hidden] aux hidden states -> [..., hidden] head input."""
        return self.fc(features)

    def forward(
        self,
        hidden: Tensor,
        ids: Tensor,
        position_ids: Tensor,
        mask: Tensor,
        cache: DynamicCache | None,
    ) -> Tensor:
        """Pre-norm outputs [b, n, hidden] of positions (hidden [b, n, H], ids, position_ids [b, n]).

        `mask` is a 4-D attention mask over [cache | new] in the form the layer's attention
        kernel takes (`tree.attention.to_attention_mask`); new KV goes to `cache`.
        """
        embeds = self.embed(ids).to(hidden.dtype)
        rope = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, embeds, rope, mask, cache)
        return hidden

    def logits(self, out: Tensor) -> Tensor:
        """Draft-vocabulary logits [..., draft_vocab] of pre-norm outputs."""
        head = self.lm_head if self.lm_head is not None else self._shared[1]
        return head(self.norm(out))

    def own_state(self) -> dict[str, Tensor]:
        """The head's tensors by canonical name, with `d2t`/`t2d` when the vocabulary is mapped."""
        state = dict(self.state_dict())
        if self.token_ids is not None:
            ids = self.token_ids.cpu()
            state["d2t"] = ids - torch.arange(ids.shape[0])
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            state["t2d"] = t2d
        return state
