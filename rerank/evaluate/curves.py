"""Per-prompt sums of per-budget value curves, kept over the evaluation pass: matched-size
PEARL and node-equivalent budgets in any bootstrap resample (`rerank.report.summary`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from torch import Tensor

from specrank.runtime.jit import njit


@dataclass
class PromptCurves:
    """Per-(temperature, prompt) sums over rounds of per-budget curves.

    `pearl` and `size/pearl` (PEARL's value and tree size at each pre-draw
    budget) find the matched-size PEARL budget, `draft` (draft selection's
    value at each budget) the node-equivalent budgets, in any bootstrap
    resample without keeping a [rounds, pool] curve per round.
    """

    sums: dict[str, dict[tuple[float, str], np.ndarray]] = field(default_factory=dict)

    def add(
        self, temperature: np.ndarray, prompt_id: np.ndarray, curves: dict[str, Tensor]
    ) -> None:
        """Add a chunk's `curve/<name>` tensors ([R, P]) to the per-prompt sums.

        Each chunk's sums are pandas' `groupby().sum()` of the float64 curves, bit for
        bit (its compensated summation, `_group_sums`), without building a DataFrame.
        """
        self.merge(self.part(temperature, prompt_id, curves))

    @staticmethod
    def part(
        temperature: np.ndarray, prompt_id: np.ndarray, curves: dict[str, Tensor]
    ) -> list[tuple[str, list, np.ndarray]]:
        """A chunk's per-prompt sums of each curve (computed anywhere; `merge` in chunk order)."""
        # (temperature, prompt) groups in order of first appearance, as a MultiIndex's
        # factorize gives them, from two flat factorizations (building the MultiIndex took
        # 3% of the pool pass)
        prompt_code, prompts = pd.factorize(prompt_id)
        t_code, temps = pd.factorize(temperature.astype(np.float64))
        labels, pairs = pd.factorize(prompt_code.astype(np.int64) * len(temps) + t_code)
        groups = [(temps[k % len(temps)], prompts[k // len(temps)]) for k in pairs]
        return [(name, groups, _group_sums(curve.float().contiguous().numpy(), labels,
                                           len(groups))) for name, curve in curves.items()]  # fmt: skip

    def merge(self, part: list[tuple[str, list, np.ndarray]]) -> None:
        """Add a chunk's sums to the running per-prompt sums."""
        for name, groups, sums in part:
            store = self.sums.setdefault(name, {})
            for key, row in zip(groups, sums, strict=True):
                if key in store and store[key].shape != row.shape:
                    raise ValueError(f"pools of different sizes within prompt {key[1]!r}")
                store[key] = store.get(key, 0.0) + row

    def array(self, name: str, temperature: float, prompts: np.ndarray) -> np.ndarray:
        """[n_prompts, P] sums of curve `name` in the order of `prompts`."""
        store, t = self.sums[name], float(temperature)
        return np.stack([store[(t, p)] for p in prompts])


@njit(nogil=True)
def _group_sums(values: np.ndarray, labels: np.ndarray, n_groups: int) -> np.ndarray:
    """Per-group column sums of float32 rows in float64, as pandas' group_sum computes them.

    Row by row, Kahan-compensated; NaN skipped; a compensation made NaN by an
    infinite value reset to 0 (pandas GH#53606). [n_groups, P] float64.
    """
    n_rows, width = values.shape
    total = np.zeros((n_groups, width), dtype=np.float64)
    comp = np.zeros((n_groups, width), dtype=np.float64)
    for i in range(n_rows):
        g = labels[i]
        for j in range(width):
            val = np.float64(values[i, j])
            if val != val:
                continue
            y = val - comp[g, j]
            t = total[g, j] + y
            comp[g, j] = t - total[g, j] - y
            if comp[g, j] != comp[g, j]:
                comp[g, j] = 0.0
            total[g, j] = t
    return total
