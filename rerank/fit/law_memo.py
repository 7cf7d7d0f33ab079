"""What the cross-fits of one law's frame compute alike for every feature set.

The default job cross-fits three feature sets (base, rows, rows_extra) on the same rows of
each law. Their folds' training masks, labels and token priors, the prompts' grouping
check and early stopping's inner splits (with their priors) depend on the rows and the
settings, never on the feature set: computed for each set they were 2.9 of the job's CPU
seconds, two thirds of it repeats (docs/benchmarks.md). A `LawMemo` keeps each part
the first set computes and gives it to the others.

One memo serves one law's frame (`rerank.fit.predict.predict_first_factors` makes one per
law); a key names every setting its part depends on beside that frame. The two halves' fits
may run in two threads at once: their keys differ (each names its own training rows), and
a part computed twice by a race would be the same value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np


class LawMemo:
    """Parts of one law's cross-fits by key, each computed once (`get`)."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, Any] = {}

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The part under ``key``, made by ``make()`` the first time."""
        if key not in self._parts:
            self._parts[key] = make()
        return self._parts[key]

    def __len__(self) -> int:
        return len(self._parts)


def rows_key(rows: np.ndarray) -> str:
    """A key of a row selection (indices or a mask): the digest of its bytes."""
    a = np.ascontiguousarray(rows)
    return hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest() + str(a.dtype)
