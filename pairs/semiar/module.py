"""The semi-autoregressive drafters' modules: a DFlash backbone (`pairs.block.module`) whose
block rows are corrected by a head conditioned on the drafted path. Our own code of the
references' layouts (pinned in `pairs.semiar.layout`); parameter names are theirs, so their
state dicts load as they are.

    dspark  DeepSpec's `Qwen3DSparkModel`: its own `embed_tokens` and `lm_head` (the reference
            drafts with them, not the target's); row k drafts the token at r + k + 1.
            Markov head (`markov_head`): bias = W2 (W1[x_prev])           `vanilla`
                                         bias = W2 (g * W1[x_prev]),     `gated`
                                         g = sigmoid(gate_proj([h_k ; W1[x_prev]]))
            Confidence head (`confidence_head.proj`): a logit of acceptance from h_k, or
            [h_k ; W1[x_prev]] with `confidence_head_with_markov`.
    domino  SpecForge's `DominoDraftModel`: the target's embedding and lm_head; `prefix_gru`
            (a GRU without biases over the target's embeddings of the path's tokens, the root
            first) and `embed_proj` (Linear, SiLU, Linear to the vocabulary):
            bias = embed_proj([h_row ; s(path)]) on rows past `pure_draft_prefix_len`.

Either way a node's children row is base[row] + bias(node), where the bias depends on the node
(its token; for Domino the GRU state carried down its path), so siblings' children differ.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pairs.block.module import BlockDrafterModule


class MarkovHead(nn.Module):
    """DSpark's Markov head, `vanilla` or `gated` (`markov_head.py`'s names)."""

    def __init__(self, vocab: int, rank: int, hidden: int, gated: bool) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)
        self.gated = gated
        if gated:
            self.gate_proj = nn.Linear(hidden + rank, rank)

    def bias(self, prev: Tensor, hidden: Tensor) -> Tensor:
        """[n, V] corrections of rows whose previous tokens are `prev` [n] (hidden [n, H])."""
        e = self.markov_w1(prev)
        if self.gated:
            e = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], -1))).to(e.dtype) * e
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    """DeepSpec's `AcceptRatePredictor`: one linear logit."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class SemiARModule(BlockDrafterModule):
    """The backbone's parameters at the top level (`fc`, `layers.*`, `norm`, ...), the kind's
    own beside them (see the module doc)."""

    def __init__(self, spec) -> None:  # spec: pairs.semiar.layout.SemiARSpec
        b = spec.block
        super().__init__(b.layer, len(b.target_layer_ids), "shared")
        h, v = b.layer.hidden_size, spec.vocab_size
        self.kind, self.plain_rows = spec.kind, spec.plain_rows
        if spec.kind == "dspark":
            self.embed_tokens = nn.Embedding(v, h)
            self.lm_head = nn.Linear(h, v, bias=False)
            self.markov_head = MarkovHead(v, spec.rank, h, spec.variant == "gated")
            if spec.confidence != "none":
                with_markov = spec.confidence == "hidden+markov"
                self.confidence_head = ConfidenceHead(h + (spec.rank if with_markov else 0))
        else:
            self.prefix_gru = nn.GRU(h, spec.rank, num_layers=1, batch_first=True, bias=False)
            self.embed_proj = nn.Sequential(nn.Linear(h + spec.rank, spec.emb_dim, bias=False),
                                            nn.SiLU(),
                                            nn.Linear(spec.emb_dim, v, bias=False))  # fmt: skip

    def correct(self, row: int, hidden: Tensor, prev: Tensor, embed: nn.Module | None,
                state: Tensor | None) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
        """(bias [n, V] or None, the nodes' state) for the children rows of nodes `prev` [n]
        drafted from block row `row` (hidden [H]); `state` [n, G]: each node's parent's."""
        n = prev.shape[0]
        if self.kind == "dspark":
            return self.markov_head.bias(prev, hidden.expand(n, -1)), None
        x = embed(prev)[:, None, :]  # one GRU step a node, its parent's state carried down
        h0 = None if state is None else state[None].contiguous()
        out, _ = self.prefix_gru(x, h0)
        s = out[:, 0]
        if row < self.plain_rows:  # Domino's pure draft prefix: base rows only
            return None, s
        return self.embed_proj(torch.cat([hidden.expand(n, -1), s], -1)), s

    def path_bias(self, hidden: Tensor, prev: Tensor, embed: nn.Module | None) -> Tensor:
        """Teacher-forced corrections [A, D, V] of rows `hidden` [A, D, H] along given paths
        `prev` [A, D] (row j's node is prev[:, j], its path prev[:, :j + 1], the root first):
        what `correct` gives node by node down each path, for training in one call."""
        if self.kind == "dspark":
            flat = self.markov_head.bias(prev.reshape(-1), hidden.reshape(-1, hidden.shape[-1]))
            return flat.view(*prev.shape, -1)
        states, _ = self.prefix_gru(embed(prev))  # [A, D, G]: the state after each path prefix
        bias = self.embed_proj(torch.cat([hidden, states], -1))
        keep = torch.arange(prev.shape[1], device=prev.device) >= self.plain_rows
        return bias * keep[:, None].to(bias.dtype)

    def confidence(self, hidden: Tensor, prev: Tensor) -> Tensor | None:
        """DSpark's acceptance logits [n] of rows `hidden` [n, H] after tokens `prev` [n]."""
        head = getattr(self, "confidence_head", None)
        if head is None:
            return None
        feats = hidden
        if head.proj.in_features > hidden.shape[-1]:
            feats = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], -1)
        return head.proj(feats)[..., 0].float()
