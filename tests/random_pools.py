"""Random pools in pool order for selector tests (any shape, ties and zeros allowed)."""

from __future__ import annotations

import numpy as np
import torch

from selection.pool_batch import PoolBatch


def random_tree(rng: np.random.Generator, level_sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Parents and depths of a random trie whose levels have the given sizes (pool order)."""
    parent, depth, prev = [], [], [-1]
    start = 0
    for d, size in enumerate(level_sizes, start=1):
        parent += list(rng.choice(prev, size=size)) if d > 1 else [-1] * size
        depth += [d] * size
        prev = list(range(start, start + size))
        start += size
    return np.array(parent, dtype=np.int64), np.array(depth, dtype=np.int64)


def random_pool_batch(
    rng: np.random.Generator,
    n_rounds: int,
    level_sizes: list[int],
    temperature: float = 1.0,
    tie_values: bool = False,
) -> PoolBatch:
    """R rounds with independent random tries, draft log-probs and target rows.

    Children of a node get target probabilities that sum to at most 1 (the
    rest of the row's mass falls outside the pool). With `tie_values`, draft
    log-probs come from a tiny set including exactly 0, so scores tie often.
    """
    rows = [random_tree(rng, level_sizes) for _ in range(n_rounds)]
    parent = np.stack([r[0] for r in rows])
    depth = np.stack([r[1] for r in rows])
    shape = parent.shape
    if tie_values:
        draft = rng.choice(np.log([1.0, 0.5, 0.25]), size=shape).astype(np.float32)
    else:
        draft = np.log(rng.uniform(0.01, 1.0, size=shape)).astype(np.float32)
    # target edge probs: split each parent's mass among its children and an "outside" share
    raw = rng.gamma(0.5, size=shape) + 1e-3
    target = np.zeros(shape, dtype=np.float32)
    greedy = np.zeros(shape, dtype=bool)
    for r in range(n_rounds):
        for p in np.unique(parent[r]):
            kids = np.flatnonzero(parent[r] == p)
            outside = rng.gamma(0.5) + 1e-3
            w = raw[r, kids] / (raw[r, kids].sum() + outside)
            target[r, kids] = w
            # the target's argmax at p labels one of its children with prob 1/2
            if rng.random() < 0.5:
                greedy[r, kids[np.argmax(w)]] = True
    return PoolBatch(
        token=torch.from_numpy(np.tile(np.arange(shape[1]), (n_rounds, 1))),
        parent=torch.from_numpy(parent),
        depth=torch.from_numpy(depth),
        draft_logprob=torch.from_numpy(draft),
        target_prob=torch.from_numpy(target),
        greedy_edge=torch.from_numpy(greedy),
        valid=torch.ones(shape, dtype=torch.bool),
        temperature=torch.full((n_rounds,), float(temperature)),
    )
