"""What a law's cross-fits share whatever the feature set: the halves' rows (checked grouped
by prompt), the labels, each half's token prior and training prompts. Computed once per law
and kept in the law's memo (`rerank.fit.law_memo`) for its other feature sets' fits."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from rerank.fit.design import shared_strings
from rerank.fit.folds import check_grouped, train_prompts, training_masks
from rerank.fit.law_memo import LawMemo, rows_key
from rerank.fit.models import law_labels
from rerank.fit.token_prior import prior_groups, token_prior_features


class LawSplit(NamedTuple):
    """What a law's cross-fits share whatever the feature set (`law_split`)."""

    prompt_ids: np.ndarray  # object arrays whose rows share one string per distinct id
    tasks: np.ndarray
    masks: list  # (fold, training rows, predicted rows) of each half
    y: np.ndarray
    priors: list  # each fold's (token prior of every row, the prior fitted on its half)
    trained: list  # each fold's training prompts (`FittedReranker.train_prompts`)


def shared_split(memo: LawMemo | None, frame: pd.DataFrame, law: str, folds: np.ndarray,
                 *settings: Any) -> LawSplit:  # fmt: skip
    """`law_split` of these settings (train_share, seed, pseudo_count, prior_split), from
    ``memo`` when an earlier feature set computed it; ``folds`` must give each row's half."""
    if folds.shape != (len(frame),):
        raise ValueError(f"folds has shape {folds.shape}; expected ({len(frame)},)")
    key = ("split", law, rows_key(folds), *settings)
    return (LawMemo() if memo is None else memo).get(
        key, lambda: law_split(frame, law, folds, *settings)
    )


def law_split(frame: pd.DataFrame, law: str, folds: np.ndarray, train_share: float, seed: int,
              pseudo_count: float, prior_split: str) -> LawSplit:  # fmt: skip
    """The folds' rows (checked grouped by prompt), the labels, each fold's token prior and
    training prompts."""
    # Object arrays whose rows share one string per distinct id (8 bytes a row): a string
    # per row, Python's or numpy's, would cost 50-100 bytes a row at every fit.
    prompt_ids, tasks = (shared_strings(frame[c]) for c in ("prompt_id", "task"))
    check_grouped(prompt_ids, folds)
    masks = training_masks(folds, prompt_ids, tasks, train_share, seed)
    trained = [train_prompts(prompt_ids[train]) for _, train, _ in masks]
    y = law_labels(frame, law)
    tokens, by_prompt = frame["token"].to_numpy(), prior_groups(prior_split, prompt_ids)
    priors = [token_prior_features(tokens, y, train, pseudo_count, by_prompt)
              for _, train, _ in masks]  # fmt: skip
    return LawSplit(prompt_ids, tasks, masks, y, priors, trained)
