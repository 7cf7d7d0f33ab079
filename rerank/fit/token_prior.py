"""Token prior (docs/method.md#features): shrunk mean label of first-level candidates per token.

    prior(t) = (sum of labels with token t + a * m) / (count of token t + a)

with pseudo-count ``a`` (20) and ``m`` the mean label of the rows it is fitted
on; a token never seen gets ``m``. The label is ``label_is_argmax`` under greedy
decoding and ``label_target_prob`` under sampling (the reranker's own target).

Inside a cross-fitting fold (`token_prior_features`):
- rows of the PREDICTED half get the prior fitted on the whole training half
  (what a saved reranker applies to new data);
- rows of the TRAINING half are split in two parts, and each part gets the prior
  fitted on the OTHER part, including the other part's mean as the shrinkage target.
  So no training row's prior contains its own label, and the model cannot learn to
  read its label back from the prior (target leakage). The split (`rerank.prior_split`):
  `prompt` (the default) alternates the training half's prompts in order of first
  appearance, so a row's prior holds no label of its own prompt either, as a held-out
  row's never does; `row` (the paper's, `experiment=paper`) alternates the rows by
  their position among the training rows (1st, 3rd, ... -> part 0; 2nd, 4th, ... -> 1),
  so a prior may hold labels of the same token from the same prompt.
Row order is the caller's: sort the frame deterministically (e.g. by prompt,
round, candidate) first if the split must be reproducible across reads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from specrank.settings.checks import check_choice
from specrank.settings.errors import Refusal

DEFAULT_PSEUDO_COUNT = 20.0
log = logging.getLogger(__name__)


class TokenPrior(BaseEstimator):
    """Shrunk per-token mean of a label; ``fit(tokens, labels)``, ``transform(tokens)``."""

    def __init__(self, pseudo_count: float = DEFAULT_PSEUDO_COUNT) -> None:
        self.pseudo_count = pseudo_count

    def fit(self, tokens: np.ndarray, labels: np.ndarray) -> TokenPrior:
        tokens = np.asarray(tokens, dtype=np.int64).ravel()
        labels = np.asarray(labels, dtype=np.float64).ravel()
        if tokens.shape != labels.shape:
            raise ValueError(f"tokens shape {tokens.shape} != labels shape {labels.shape}")
        if tokens.size == 0:
            raise ValueError("TokenPrior.fit: no rows (the training part is empty)")
        if not np.isfinite(labels).all():
            raise ValueError(
                f"TokenPrior.fit: labels must be finite; found {int((~np.isfinite(labels)).sum())} "
                f"non-finite value(s)"
            )
        if not self.pseudo_count > 0:
            raise ValueError(f"pseudo_count must be > 0; got {self.pseudo_count!r}")
        uniq, inverse = np.unique(tokens, return_inverse=True)
        self.tokens_ = uniq
        self.sums_ = np.bincount(inverse, weights=labels, minlength=uniq.size)
        self.counts_ = np.bincount(inverse, minlength=uniq.size).astype(np.int64)
        self.mean_ = float(labels.mean())
        return self

    def transform(self, tokens: np.ndarray) -> np.ndarray:
        """Prior of each token (float32); unseen tokens get ``mean_``."""
        check_is_fitted(self, "tokens_")
        tokens = np.asarray(tokens, dtype=np.int64).ravel()
        a = float(self.pseudo_count)
        out = np.full(tokens.shape, self.mean_, dtype=np.float64)
        if self.tokens_.size:
            pos = np.searchsorted(self.tokens_, tokens)
            pos_c = np.minimum(pos, self.tokens_.size - 1)
            seen = self.tokens_[pos_c] == tokens
            idx = pos_c[seen]
            out[seen] = (self.sums_[idx] + a * self.mean_) / (self.counts_[idx] + a)
        return out.astype(np.float32)

    # -- JSON-able state (for the safe saved-model sidecar) ---------------------------
    def to_dict(self) -> dict:
        check_is_fitted(self, "tokens_")
        return {
            "pseudo_count": float(self.pseudo_count),
            "mean": self.mean_,
            "tokens": self.tokens_.tolist(),
            "sums": self.sums_.tolist(),
            "counts": self.counts_.tolist(),
        }

    @classmethod
    def from_dict(cls, state: dict) -> TokenPrior:
        prior = cls(pseudo_count=float(state["pseudo_count"]))
        prior.tokens_ = np.asarray(state["tokens"], dtype=np.int64)
        prior.sums_ = np.asarray(state["sums"], dtype=np.float64)
        prior.counts_ = np.asarray(state["counts"], dtype=np.int64)
        prior.mean_ = float(state["mean"])
        n = prior.tokens_.size
        if prior.sums_.size != n or prior.counts_.size != n:
            raise ValueError(
                f"token prior state: {n} tokens but {prior.sums_.size} sums and "
                f"{prior.counts_.size} counts"
            )
        if n and not (np.diff(prior.tokens_) > 0).all():
            raise ValueError("token prior state: tokens must be strictly increasing")
        return prior


PRIOR_SPLITS = ("prompt", "row")


def prior_groups(prior_split: str, prompts: np.ndarray | None) -> np.ndarray | None:
    """The groups the token prior alternates: the prompts, or None to alternate by row."""
    check_choice("rerank.prior_split", prior_split, PRIOR_SPLITS)
    if prior_split == "prompt" and prompts is None:
        raise ValueError("rerank.prior_split=prompt needs the frame's prompt_id column")
    return prompts if prior_split == "prompt" else None


def alternation_parts(n: int, groups: np.ndarray | None = None) -> np.ndarray:
    """Part (0/1) of each of ``n`` training rows: in row order 0, 1, 0, 1, ...; with
    ``groups`` (each row's prompt), by prompt in order of first appearance, every row of a
    prompt in its prompt's part."""
    if groups is None:
        return (np.arange(n) % 2).astype(np.int8)
    _, first, inverse = np.unique(np.asarray(groups), return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))  # each prompt's place by first appearance
    return (rank[inverse.ravel()] % 2).astype(np.int8)


@dataclass(frozen=True)
class PriorColumn:
    """Where a design matrix holds the token prior, and what recomputes it inside a split."""

    column: int  # the token prior's column of X
    tokens: np.ndarray  # [N] every row's token (rows of X)
    pseudo_count: float = DEFAULT_PSEUDO_COUNT
    by_prompt: bool = True  # alternation by prompt (else by row: rerank.prior_split)


def split_priors(
    prior: PriorColumn,
    labels: np.ndarray,
    rows: np.ndarray,
    held: np.ndarray,
    groups: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """The token prior of an inner split (early stopping), from its training rows alone.

    ``rows`` index the training half in X; ``held`` marks its held-out (validation) rows;
    ``labels`` and ``groups`` are the training half's. The inner rows get alternation priors
    over the inner rows, the held-out rows the prior fitted on all inner rows, as a
    predicted half does: no prior reads a held-out label. Returns (inner, held) priors.
    """
    tokens = prior.tokens[rows]
    by = None if groups is None or not prior.by_prompt else np.asarray(groups)[~held]
    # fewer than two prompts, found without sorting the rows' strings (2.6 s a job at paper
    # scale with np.unique): rows of one prompt share its string, compared by identity first
    if by is not None and (by.size == 0 or not (by != by[0]).any()):
        # An inner split of a tiny training half can leave its fit one prompt: no prompt
        # alternation exists there, so its rows alternate (said, not silent).
        log.warning("early stopping's inner split trains on one prompt: its token prior "
                    "alternates by row there")  # fmt: skip
        by = None
    inner, full = token_prior_features(
        tokens[~held], labels[~held], np.ones(int((~held).sum()), bool), prior.pseudo_count, by
    )
    return inner, full.transform(tokens[held])


def token_prior_features(
    tokens: np.ndarray,
    labels: np.ndarray,
    train_mask: np.ndarray,
    pseudo_count: float = DEFAULT_PSEUDO_COUNT,
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, TokenPrior]:
    """Token prior of every row for one fold, and the prior fitted on the whole training half.

    Rows with ``train_mask`` get the alternation priors (module doc: by prompt when
    ``groups``, each row's prompt, is given; else by row); all other rows get the
    whole-training-half prior. Labels of non-training rows are never read (they may be NaN).
    """
    tokens = np.asarray(tokens, dtype=np.int64).ravel()
    labels = np.asarray(labels, dtype=np.float64).ravel()
    train_mask = np.asarray(train_mask, dtype=bool).ravel()
    groups = None if groups is None else np.asarray(groups).ravel()
    if groups is not None and groups.shape != tokens.shape:
        raise ValueError(f"groups {groups.shape} must have the shape of tokens {tokens.shape}")
    if not (tokens.shape == labels.shape == train_mask.shape):
        raise ValueError(
            f"tokens {tokens.shape}, labels {labels.shape} and train_mask {train_mask.shape} "
            f"must have the same shape"
        )
    train_idx = np.flatnonzero(train_mask)
    if train_idx.size < 2:
        raise Refusal(
            f"the training half has {train_idx.size} row(s); the alternation split of the token "
            f"prior needs >= 2 (expected a candidate table, rerank.features, with more rows at "
            f"each temperature)"
        )
    full = TokenPrior(pseudo_count).fit(tokens[train_idx], labels[train_idx])
    out = np.empty(tokens.shape, dtype=np.float32)
    out[~train_mask] = full.transform(tokens[~train_mask])
    parts = alternation_parts(train_idx.size, None if groups is None else groups[train_idx])
    if parts.min() == parts.max():
        # the input at fault is the table's prompt count, not the code: a message, no trace
        raise Refusal(
            "The training half has one prompt; the prompt alternation of the token prior "
            "(rerank.prior_split=prompt) needs >= 2. The candidate table (rerank.features) "
            "holds too few prompts at one temperature: use traces of >= 4 prompts at each "
            "temperature (2 to train on in each half; more under rerank.train_share < 1), or "
            "rerank.prior_split=row with rerank.booster.early_stopping=false (early stopping "
            "holds a training prompt out too)."
        )
    for part in (0, 1):
        mine, other = train_idx[parts == part], train_idx[parts != part]
        prior = TokenPrior(pseudo_count).fit(tokens[other], labels[other])
        out[mine] = prior.transform(tokens[mine])
    return out, full
