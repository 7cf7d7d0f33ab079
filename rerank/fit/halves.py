"""The two prompt halves of cross-fitting (docs/method.md#cross-fitting): which half each
prompt is in (`prompt_halves`, once over every prompt: `fold_map`), each row's half looked up
from that map (`frame_folds`, `prompt_folds`), and the split's table. What is fitted within
the halves lives in `rerank.fit.folds`.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import pandas as pd

from rerank.evaluate.pool_chunks import ROUND_KEYS
from rerank.fit.design import per_value
from rerank.fit.folds import prompt_tasks
from specrank.settings.checks import check_choice
from specrank.settings.errors import Refusal

SCHEMES = ("even_odd", "seeded")


_TRAILING_INT = re.compile(r"(\d+)$")


# Even/odd halves are used only when, in every task, |n0 - n1| <= max(1, n // 10) for
# the task's n prompts (n0, n1 in halves 0, 1): 10% leaves room for a task with an odd
# count or a few gaps in its numbering, and no more, since a lopsided task would be
# fitted on few prompts and then predict many.
BALANCE_SHARE = 10  # n // BALANCE_SHARE is 10% of a task's prompts


def balance_tolerance(n_prompts: int) -> int:
    """Largest |n0 - n1| allowed between the halves of a task with `n_prompts` prompts."""
    return max(1, n_prompts // BALANCE_SHARE)


def _even_odd(uniq: np.ndarray, tasks: np.ndarray) -> np.ndarray:
    per_prompt = np.empty(uniq.size, dtype=np.int8)
    bad = []
    for i, pid in enumerate(uniq):
        m = _TRAILING_INT.search(pid)
        if m is None:
            bad.append(pid)
        else:
            # The last digit alone decides parity (no overflow on long ids).
            per_prompt[i] = int(m.group(1)[-1]) % 2
    if bad:
        raise Refusal(
            f"The 'rerank.halves' scheme 'even_odd' needs prompt ids ending in an integer (e.g. "
            f"'spec_bench-81'); {len(bad)} of {uniq.size} prompts do not, e.g. {bad[:5]}. "
            f"Use rerank.halves=seeded for such ids."
        )
    counts, lopsided = [], []
    for task in np.unique(tasks):
        n0, n1 = (int(c) for c in np.bincount(per_prompt[tasks == task], minlength=2))
        name = str(task) or "(all prompts)"
        counts.append(f"{name} {n0}/{n1}")
        if abs(n0 - n1) > balance_tolerance(n0 + n1):
            lopsided.append(name)
    if lopsided:
        raise Refusal(
            f"The 'rerank.halves' scheme 'even_odd' must give every task balanced halves, "
            f"|n0 - n1| <= max(1, n // {BALANCE_SHARE}) for a task of n prompts; "
            f"prompts per task in halves 0/1 (even/odd): {', '.join(counts)}; "
            f"unbalanced: {lopsided}. Use rerank.halves=seeded (stratified by task) instead."
        )
    return per_prompt


def _seeded(uniq: np.ndarray, tasks: np.ndarray, seed: int) -> np.ndarray:
    per_prompt = np.ones(uniq.size, dtype=np.int8)
    sizes = np.zeros(2, dtype=np.int64)
    for task in np.unique(tasks):
        members = np.flatnonzero(tasks == task)  # sorted ids: independent of row order
        # One stream per (seed, task): a task's shuffle does not move when another
        # task gains or loses prompts (at most which half gets its odd prompt does).
        rng = np.random.default_rng([seed, zlib.crc32(task.encode("utf-8"))])
        order = members[rng.permutation(members.size)]
        half = members.size // 2
        # An odd task's extra prompt goes to the half that is smaller so far (a coin
        # on a tie), so the halves stay balanced overall too, not only per task.
        extra = int(rng.integers(2)) if sizes[0] == sizes[1] else int(np.argmin(sizes))
        n0 = half + (members.size % 2 if extra == 0 else 0)
        per_prompt[order[:n0]] = 0
        sizes += (n0, members.size - n0)
    return per_prompt


def prompt_halves(
    prompt_ids: np.ndarray,
    scheme: str = "even_odd",
    seed: int = 0,
    tasks: np.ndarray | None = None,
) -> np.ndarray:
    """Fold id (int8, 0/1) per row, the same for every row of a prompt.

    ``tasks`` (one label per row, constant within a prompt; None = one task)
    is what the halves are balanced over.

    ``even_odd`` (the paper): the trailing integer of the prompt id decides,
    even -> 0, odd -> 1 ("spec_bench-81" -> 1, "HumanEval/3" -> 1,
    "synth-000012" -> 0). Ids without a trailing number are refused: guessing a
    number for them would silently make the split depend on string details.
    So are halves that come out lopsided in some task (beyond
    `balance_tolerance`), with the counts per task and half in the message.

    ``seeded``: stratified by task: within each task, a seeded random half of
    its distinct prompts (sorted first, so the split depends only on the set
    of prompts, their tasks and ``seed``, not on row order) gets fold 0, so
    every task's halves differ by at most one prompt; an odd task's extra
    prompt goes to the half that is smaller so far, so the totals differ by at
    most one as well.

    Raises a Refusal when either half would be empty: nothing could be
    trained for the other half.
    """
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1:
        raise ValueError(f"prompt_ids must be 1-D; got shape {ids.shape}")
    if ids.size == 0:
        raise ValueError("prompt_ids is empty: nothing to split")
    check_choice("rerank.halves", scheme, SCHEMES)
    uniq, per_task, inverse = prompt_tasks(ids, tasks)
    per_prompt = (
        _even_odd(uniq, per_task) if scheme == "even_odd" else _seeded(uniq, per_task, seed)
    )
    counts = np.bincount(per_prompt, minlength=2)
    if counts.min() == 0:
        raise Refusal(
            f"rerank.halves={scheme} puts all {uniq.size} prompts in fold "
            f"{int(np.argmax(counts))}; cross-fitting needs prompts in both halves (expected a "
            f"candidate table, rerank.features, of more prompts)"
        )
    return per_prompt[inverse]


def fold_map(prompt_ids: np.ndarray, scheme: str, seed: int,
             tasks: np.ndarray | None = None) -> dict[str, int]:  # fmt: skip
    """prompt id -> fold (0/1), computed once over ALL prompts so chunks agree.

    ``tasks`` (aligned with ``prompt_ids``) balances the halves within each task
    (`prompt_halves`); without it all prompts count as one task.
    """
    if tasks is None:
        unique = np.unique(prompt_ids)
        return dict(zip(unique.tolist(), prompt_halves(unique, scheme, seed).tolist(), strict=True))
    # One row per (prompt, task) pair: the split works on prompts, not on millions of rows;
    # a prompt with two tasks survives as two rows and is refused by prompt_halves.
    pairs = pd.DataFrame({"prompt_id": prompt_ids, "task": tasks}).drop_duplicates()
    pids = pairs["prompt_id"].to_numpy().astype(str)
    folds = prompt_halves(pids, scheme, seed, tasks=pairs["task"].to_numpy().astype(str))
    return dict(zip(pids.tolist(), folds.tolist(), strict=True))


def halves_table(frame: pd.DataFrame, folds: dict[str, int]) -> pd.DataFrame:
    """Prompts and rounds per task and half (plus an `all` row), to print and log the split.

    ``frame`` has `prompt_id`, `task` and the round keys (candidate or round rows,
    any multiplicity); columns `prompts_0`, `prompts_1`, `rounds_0`, `rounds_1`
    count prompts and distinct rounds (all laws together) in halves 0 and 1.
    """
    keys = [k for k in ROUND_KEYS if k in frame.columns]
    rounds = frame[["task", *keys]].drop_duplicates()
    rounds = rounds.assign(half=rounds["prompt_id"].map(folds))
    if rounds["half"].isna().any():
        raise ValueError("rows with prompts outside the fold map")
    grouped = rounds.groupby(["task", "half"])
    table = pd.concat(
        {"prompts": grouped["prompt_id"].nunique(), "rounds": grouped.size()}, axis=1
    ).unstack("half", fill_value=0)
    table = table.reindex(columns=pd.MultiIndex.from_product([["prompts", "rounds"], [0, 1]]),
                          fill_value=0)  # fmt: skip
    table.columns = [f"{what}_{int(half)}" for what, half in table.columns]
    table.loc["all"] = table.sum()
    table.index.name = "task"
    return table.astype(np.int64)


def prompt_folds(prompt_id: pd.Series, folds: dict[str, int]) -> np.ndarray:
    """Each row's fold (-1: a prompt outside the fold map), looked up once per distinct
    prompt (`per_value`; a dictionary-encoded Arrow column converts to a categorical one
    without a string per row): a per-row map of the strings slowed the per-depth maps' fit
    at paper scale."""
    return per_value(prompt_id, lambda ids: np.array([folds.get(p, -1) for p in ids], np.int64), -1)


def frame_folds(frame: pd.DataFrame, folds: dict[str, int]) -> np.ndarray:
    """The fold (int8) of each row's prompt; refuses prompts outside the fold map."""
    fold = prompt_folds(frame["prompt_id"], folds)
    if (fold < 0).any():
        raise ValueError("candidate rows with prompts outside the fold map")
    return fold.astype(np.int8)
