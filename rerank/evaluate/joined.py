"""The pass's per-chunk results joined into whole-store arrays without a second copy.

Chunks are merged in the store's order; the tables group rounds by law. A plain
`pd.concat` of the chunks' frames holds every round twice, and a `groupby` over laws
copies each law's rows once more. Here each chunk's array is placed once into the joined
array and freed, and the rows can be put law by law (`law_major_order`) so each law's
rows are a slice of the joined table: a view, not a copy. Within a law the rows keep the chunks'
order, which is the order `groupby` gives, so every sum runs over the same values in
the same order and the tables are the same bits.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from specrank.runtime.memory import release_freed_heap

# The parts were allocated in the pass, on the heap it keeps (`specrank.runtime.memory.heap_retained`),
# where a freed part stays resident until the heap is trimmed: placing them all before a trim
# held every part twice (the 10x job's report tables peaked 2.9 GiB over the pass's end).
TRIM_BYTES = 256 * 2**20


def law_major_order(temperature: np.ndarray) -> np.ndarray:
    """Row positions law by law (sorted temperatures), each law's rows in their order."""
    return np.argsort(temperature, kind="stable")


def law_spans(temperature: np.ndarray) -> list[tuple[float, slice]]:
    """(temperature, its rows) of law-ordered rows (`law_major_order`'s result)."""
    if temperature.size and np.any(temperature[1:] < temperature[:-1]):
        raise ValueError("law_spans needs rows put law by law (law_major_order)")
    laws, starts = np.unique(temperature, return_index=True)
    ends = [*starts[1:], temperature.size]
    return [(float(t), slice(int(a), int(b))) for t, a, b in zip(laws, starts, ends, strict=True)]


def law_ordered_frame(frames: list[pd.DataFrame]) -> tuple[pd.DataFrame, np.ndarray]:
    """(the chunks' frames end to end, law by law; `law_major_order` of their rows), the
    frames taken from the list (it is empty after) and the heap trimmed once they are freed."""
    frame = pd.concat(frames, ignore_index=True)
    frames.clear()
    release_freed_heap()
    order = law_major_order(frame["temperature"].to_numpy())
    return frame.take(order).reset_index(drop=True), order


def joined_rows(parts: list[np.ndarray], order: np.ndarray | None = None) -> np.ndarray:
    """`np.concatenate(parts)[order]` (rows), each part freed (popped) once placed: the
    parts and the result are never both held whole. `order` None: the parts' order."""
    n = sum(len(p) for p in parts)
    out = np.empty((n, *parts[0].shape[1:]), dtype=parts[0].dtype)
    _place(parts, _destinations(order, n), out)
    return out


def joined_columns(
    values: list[dict[str, np.ndarray]], order: np.ndarray | None = None
) -> pd.DataFrame:
    """The chunks' value columns end to end (rows in `order`, None: the chunks'), as one
    float64 block (the values must be exact in it) written a column at a time, each chunk's
    array freed once copied in: the values are held once, where a concat of whole chunk
    tables holds them twice. One block, as that concat gave: a block per column makes
    pandas warn when columns are added."""
    names = list(values[0])
    n = sum(len(cols[names[0]]) for cols in values)
    out = np.empty((n, len(names)), order="F")
    dest = _destinations(order, n)  # once for every column
    for j, name in enumerate(names):
        _place([cols.pop(name) for cols in values], dest, out[:, j])
    return pd.DataFrame(out, columns=names, copy=False)  # F order: the block is out's view


def _destinations(order: np.ndarray | None, n: int) -> np.ndarray | None:
    """Where each row of the concatenation goes (the inverse of `order`; None: in place)."""
    if order is None:
        return None
    dest = np.empty(n, dtype=np.int64)
    dest[order] = np.arange(n)
    return dest


def _place(parts: list[np.ndarray], dest: np.ndarray | None, out: np.ndarray) -> None:
    """Each part's rows into `out` at `dest` (None: end to end), popped once placed; the
    heap trimmed every `TRIM_BYTES` freed."""
    lo, freed = 0, 0
    while parts:
        part = parts.pop(0)
        rows = slice(lo, lo + len(part))
        out[rows if dest is None else dest[rows]] = part
        lo += len(part)
        freed += part.nbytes
        del part
        if freed >= TRIM_BYTES or not parts:
            release_freed_heap()
            freed = 0
