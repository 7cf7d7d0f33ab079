"""Verification (docs/method.md#verification-4): score root + scored set in one target pass, then traverse the tree.

Scored set Q = verified tree T  ∪  expanded nodes  ∪  the top-M draft-ranked candidates.
All three are ancestor-closed, so Q is too: every scored position finds its
ancestors inside the batch. Every pool candidate's parent is the root or an
expanded node, so the pass yields the target probability of *every* pool edge.

Traversal is written as one "outcome token" per verifier row (root and tree
nodes), computed for all rows at once on the device:

    greedy     : o(u) = argmax p(. | u)
    exhaustive : o(u) ~ p_T(. | u)                       (independent draws)
    EAGLE-3    : visit u's tree children c1, c2, ... in pool order; accept c_j with
                 prob p(c_j) / (1 - p(c1) - ... - p(c_{j-1})); o(u) = first accepted child,
                 else a draw from p_T(. | u) with the children removed
    coupling   : chains whose node c was drawn from the drafter's q(. | u) (T_d > 0):
                 accept c with prob min(1, p(c) / q(c)), else o(u) ~ (p - q)+ normalised
                 (speculative sampling's maximal coupling, DFlash's block acceptance at
                 1|1). Given c ~ q, o(u) ~ p; it accepts at least as often as EAGLE-3's
                 p(c), which is this rule with q a point mass (drafting at T_d = 0).

A node is accepted when it and each of its ancestors is labelled by the outcome
at its parent; the accepted nodes form one root path (siblings carry distinct
tokens) and the continuation is the outcome at its last node. Draws at rows the
traversal never reaches are discarded, which leaves the law unchanged because
draws at different rows are independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from tree.attention import forward_tree, tree_visibility
from tree.pool import Pool

VERIFIERS = ("exhaustive", "eagle3", "coupling")


@dataclass
class Selection:
    """The verified tree and the scored set of one round, over the pool (on the device)."""

    # [P] int64, draft rank (0 = best; docs/method.md#ranking) whatever the rule: it picks the
    # retained rows' prefixes (tree.retained), as in the recorded traces
    rank: Tensor
    in_tree: Tensor  # [P] bool, the B-node verified tree
    scored: Tensor  # [P] bool, Q: tree ∪ expanded ∪ top-M
    batch_row: Tensor  # [P] int64, row of the node in the verification batch; -1 unscored


@torch.inference_mode()
def verification_pass(
    target: PreTrainedModel,
    cache: DynamicCache,
    root_token: Tensor,
    root_position: int,
    pool: Pool,
    scored_idx: Tensor,
) -> Tensor:
    """Target logits at the root and at every scored prefix. [1 + |Q|, vocab], model dtype.

    root_token: [1]; scored_idx: [|Q|] pool indices, ascending. The target cache
    holds exactly the `root_position` committed tokens before the root.
    """
    anc = pool.anc[scored_idx][:, scored_idx]  # [|Q|, |Q|]
    n = scored_idx.shape[0]
    # Batch = [root | Q]: the root sees itself; each node sees the root and its ancestors.
    new = torch.zeros(n + 1, n + 1, dtype=torch.bool, device=anc.device)
    new[:, 0] = True
    new[1:, 1:] = anc
    vis = tree_visibility(root_position, new[:, :0], new)
    ids = torch.cat([root_token, pool.token[scored_idx]])
    pos = torch.cat(
        [root_token.new_tensor([root_position]), root_position + pool.depth[scored_idx]]
    )
    return forward_tree(target, ids, pos, vis, cache)


def parent_rows(pool: Pool, sel: Selection) -> Tensor:
    """Verification-batch row of each candidate's parent (0 = root). [P] int64."""
    return torch.where(pool.parent >= 0, sel.batch_row[pool.parent.clamp(min=0)], 0)


def law_temperature(temperature: float) -> float:
    """Rows are softmax(logits / T); greedy rounds use the unit-temperature softmax (T=0 -> 1)."""
    return temperature if temperature > 0 else 1.0


def row_logprobs(logits: Tensor, temperature: float) -> Tensor:
    """Every verified row as float32 log-probabilities at the law temperature. [n_rows, V]."""
    return torch.log_softmax(logits.float() / law_temperature(temperature), dim=-1)


def edge_logprob(row_logp: Tensor, pool: Pool, prow: Tensor) -> Tensor:
    """log p_T(token_i | prefix of parent_i) for every candidate. [P] float32."""
    return row_logp[prow, pool.token]


# -- outcome tokens --------------------------------------------------------------------------


def outcome_greedy(logits: Tensor) -> Tensor:
    """argmax at each row (first index on ties, as plain greedy decoding). [n_rows]."""
    return logits.argmax(-1)


def outcome_exhaustive(row_logp: Tensor, generator: torch.Generator) -> Tensor:
    """One independent draw from p_T at each row. [n_rows]."""
    return torch.multinomial(row_logp.exp(), 1, generator=generator)[:, 0]


def _segment_first(segment: Tensor) -> Tensor:
    """For a sequence sorted into segments (equal consecutive ids), the index of each one's segment start."""
    n = segment.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=segment.device)
    starts[1:] = segment[1:] != segment[:-1]
    idx = torch.where(starts, torch.arange(n, device=segment.device), 0)
    return torch.cummax(idx, dim=0).values


def outcome_eagle3(
    row_logp: Tensor, child_token: Tensor, child_parent_row: Tensor, generator: torch.Generator
) -> Tensor:
    """EAGLE-3's child-by-child verifier, all rows at once. [n_rows].

    child_token, child_parent_row: [C] tree children in pool order and the batch
    row of each one's parent. Siblings are tested in that order.
    """
    probs = row_logp.exp()  # [n_rows, V] float32
    # Group siblings (a stable sort keeps their pool order), then segmented sums.
    order = torch.sort(child_parent_row, stable=True).indices
    rows, toks = child_parent_row[order], child_token[order]  # [C]
    first = _segment_first(rows)  # [C] index of the first sibling
    p = probs[rows, toks].double()  # float64: the running sums below span many siblings
    before = p.cumsum(0) - p  # exclusive running sum
    rejected_mass = before - before[first]  # [C] p(c1) + ... + p(c_{j-1}) within the sibling group
    # Probability of c_j in the row renormalised after its earlier siblings were removed.
    accept_prob = (p / (1 - rejected_mass).clamp(min=1e-30)).clamp(max=1.0)
    u = torch.rand(rows.shape, generator=generator, device=probs.device, dtype=torch.float64)
    accepted = u < accept_prob  # [C]
    acc_before = accepted.long().cumsum(0) - accepted.long()
    chosen = accepted & (acc_before == acc_before[first])  # the first accepted sibling
    # Residual row: children removed (multinomial renormalises).
    residual = probs.clone()
    residual[rows, toks] = 0.0
    # If the children hold all the mass the last one is accepted with probability 1;
    # a placeholder row keeps multinomial defined and its draw is never used.
    residual[residual.sum(-1) <= 0] = 1.0
    draw = torch.multinomial(residual, 1, generator=generator)[:, 0]  # [n_rows]
    out = draw.clone()
    out[rows[chosen]] = toks[chosen]  # at most one chosen child per row
    return out


def accepted_mask(pool: Pool, in_tree: Tensor, prow: Tensor, outcome: Tensor) -> Tensor:
    """Tree nodes on the accepted path. [..., P] bool (a leading batch of outcomes broadcasts).

    A node is accepted when it and all its ancestors are labelled by the outcome
    at their parent's row: outcome [..., n_rows] -> accepted [..., P].
    """
    match = in_tree & (pool.token == outcome[..., prow])  # [..., P]
    return in_tree & ~(pool.anc & ~match[..., None, :]).any(-1)


def outcome_coupling(
    row_logp: Tensor, child_token: Tensor, child_parent_row: Tensor, child_logq: Tensor,
    child_q_row: Tensor, generator: torch.Generator,
) -> Tensor:  # fmt: skip
    """Maximal coupling at each row with one tree child (a chain). [n_rows].

    child_*: [C] the tree's nodes, their parent's batch row, log q(c | parent) at the
    drafter's temperature; child_q_row: [C, V] q(. | parent) over the target's vocabulary
    (probabilities). Rows without a child draw from p.
    """
    probs = row_logp.exp()  # [n_rows, V] float32
    p = probs[child_parent_row, child_token].double()
    ratio = (p / child_logq.double().exp()).clamp(max=1.0)
    u = torch.rand(p.shape, generator=generator, device=probs.device, dtype=torch.float64)
    accepted = u < ratio  # [C]
    residual = probs.clone()
    residual[child_parent_row] = (probs[child_parent_row] - child_q_row).clamp(min=0.0)
    # p <= q everywhere means p == q: c is accepted with probability 1 and this draw unused
    residual[residual.sum(-1) <= 0] = 1.0
    out = torch.multinomial(residual, 1, generator=generator)[:, 0]
    out[child_parent_row[accepted]] = child_token[accepted]
    return out
