"""Agreement of retained rows with the next root row (paper Tables 22, 23, 26).

Round t's pass leaves rows that round t+1 compares with its own root row; the
trace stores the comparison on round t+1 (`matched_tv`, `token_only_tv`, ...,
null where the row is absent). Row kinds (docs/method.md#retained-rows):

  matched           the row at round t's emitted address (round t was covered)
  token_only        other scored rows of round t ending in the continuation
  token_only_path   those among them on round t's accepted path (the root row,
                    when the root token is the continuation, counts as on the path:
                    it too sits at a prefix of the next root's own context)
  token_only_other  the rest of the token-only rows
  cache, same, preceding   token-keyed cache, same-token and preceding rows

Which token-only rows lie on the path is rebuilt from round t's pool (the trace
lists them in pool order: root first when it qualifies, then up to 24 scored
prefixes ending in the continuation, the emitted address excluded), so round t
may lie in another chunk: per-round bitmasks are joined by key at the end.
Rounds whose recorded list length differs from that rebuild (e.g. synthetic
traces) are left out of the path/other split and counted in `unsplit_rounds`.

Match rates (Table 22), per round t: `token_match_tree` — the root or a
verified prefix ends in the continuation (a same-token row exists);
`token_match_scored` — the root or a scored prefix does; `address_match` — the
emitted address was scored (`covered`: an exact row exists), plus the mean
numbers of tree / scored prefixes ending in the continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds

from rerank.evaluate.joined import joined_rows, law_ordered_frame, law_spans
from rerank.evaluate.pool_chunks import ROUND_KEYS, PoolChunk, RoundCodes, iter_pool_chunks
from selection.pool_batch import list_matrix, trace_matrix
from specrank.runtime.jit import njit
from specrank.statistics.laws import law_name
from tree.retained import TOKEN_ONLY_MAX

SCALAR_ROWS = {"matched": "matched", "cache": "cache", "same": "same", "preceding": "prev"}
AGREEMENT_ROWS = ("matched", "token_only", "token_only_path", "token_only_other", "cache", "same",
             "preceding")  # fmt: skip
ROW_COLUMNS = [
    "task", "cand_scored", "cand_in_tree", "accepted_path", "continuation_token", "covered",
    "token_only_tv", "token_only_argmax_agree",
    *[f"{r}_{s}" for r in SCALAR_ROWS.values() for s in ("tv", "argmax_agree")],
]  # fmt: skip
_LIST = TOKEN_ONLY_MAX + 1  # the root row joins the 24 without counting toward them
# next_round_lists' integers held in a narrower exact type over the pass (25 path bits, a
# list of at most 25; the prefix counts, at most the pool's width, by `_narrow`)
_NARROW = {"path_bits": np.int32, "n_list": np.int8}


@njit(nogil=True)
def _list_scan(token, valid, parent, scored, in_tree, path, c, root_token, list_max):  # fmt: skip
    """next_round_lists' five columns, one pass over each round's pool (see there)."""
    n_rounds, width = token.shape
    path_bits = np.zeros(n_rounds, dtype=np.int64)
    n_list = np.zeros(n_rounds, dtype=np.int64)
    tree_ending = np.zeros(n_rounds, dtype=np.int64)
    scored_ending = np.zeros(n_rounds, dtype=np.int64)
    root_is_c = np.zeros(n_rounds, dtype=np.bool_)
    for r in range(n_rounds):
        n_acc = 0
        while n_acc < path.shape[1] and path[r, n_acc] >= 0:
            n_acc += 1
        last = path[r, n_acc - 1] if n_acc > 0 else -1
        root = root_token[r] == c[r]
        root_is_c[r] = root
        pos = root - 1  # the next list's position of the last entry so far (root first)
        bits, listed = np.int64(root), np.int64(root)
        for u in range(width):
            if not valid[r, u] or token[r, u] != c[r]:
                continue
            tree_ending[r] += in_tree[r, u]
            scored_ending[r] += scored[r, u]
            if not scored[r, u] or parent[r, u] == last:  # unscored, or the emitted address
                continue
            pos += 1
            if pos < list_max + root:
                listed += 1
                for k in range(n_acc):
                    if path[r, k] == u:
                        bits |= np.int64(1) << pos
        path_bits[r], n_list[r] = bits, listed
    return path_bits, n_list, tree_ending, scored_ending, root_is_c


def next_round_lists(chunk: PoolChunk) -> dict[str, np.ndarray]:
    """What round t's pool implies for round t+1's token-only list. [R] each.

    `path_bits`: bit i set when list entry i lies on the accepted path; `n_list`:
    the list's length; `tree_ending` / `scored_ending`: verified / scored prefixes
    ending in the continuation; `root_is_c`: the root token is the continuation.
    The list: the root when its token is the continuation, then the scored prefixes
    ending in it other than the emitted address (the accepted path's last node's child),
    in pool order, at most TOKEN_ONLY_MAX. One compiled scan per round: the [R, P] torch
    masks and cumulative sums it replaced took 5-10% of the pool pass.
    """
    t, pool = chunk.table, chunk.pool
    width = pool.shape[1]
    in_tree = trace_matrix(t, "cand_in_tree", False, np.bool_, width)[0]
    path, _ = trace_matrix(t, "accepted_path", -1, np.int64)
    if path.shape[1] == 0:  # no round accepted anything: one column of "none"
        path = np.full((len(t), 1), -1, dtype=np.int64)
    cols = _list_scan(
        pool.token.contiguous().numpy(), pool.valid.contiguous().numpy(),
        pool.parent.contiguous().numpy(), chunk.scored.contiguous().numpy(),
        np.ascontiguousarray(in_tree), np.ascontiguousarray(path),
        t["continuation_token"].to_numpy().astype(np.int64),
        t["root_token"].to_numpy().astype(np.int64), TOKEN_ONLY_MAX,
    )  # fmt: skip
    names = ("path_bits", "n_list", "tree_ending", "scored_ending", "root_is_c")
    return dict(zip(names, cols, strict=True))


def _nan_if_null(col: pa.ChunkedArray) -> np.ndarray:
    # float32 holds the trace's float32 TVs and 0/1 agreements exactly (_kind_row averages
    # them in float64); null -> NaN
    return col.cast(pa.float32()).to_numpy(zero_copy_only=False)


@dataclass
class RowRounds:
    """Collects, chunk by chunk, each round's retained-row comparisons and next-list rebuild."""

    frames: list[pd.DataFrame] = field(default_factory=list)
    tv: list[np.ndarray] = field(default_factory=list)  # [R, 25] f32 token-only TV, NaN after
    agree: list[np.ndarray] = field(default_factory=list)  # [R, 25] f32 1/0, NaN past the list

    def add(self, chunk: PoolChunk) -> None:
        self.merge(self.part(chunk))

    def part(self, chunk: PoolChunk) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
        """A chunk's rows (computed anywhere; `merge` them in chunk order)."""
        t = chunk.table
        frame = chunk.keys[ROUND_KEYS].reset_index(drop=True)
        frame["covered"] = t["covered"].to_numpy(zero_copy_only=False)
        for kind, col in SCALAR_ROWS.items():
            frame[f"{kind}_tv"] = _nan_if_null(t[f"{col}_tv"])
            frame[f"{kind}_agree"] = _nan_if_null(t[f"{col}_argmax_agree"])
        count = np.int16 if chunk.pool.shape[1] < 2**15 else np.int32  # 710 in the paper
        for k, v in next_round_lists(chunk).items():
            frame[k] = v.astype(_NARROW.get(k, count if k.endswith("_ending") else v.dtype))
        frame["n_token_only"] = (
            t["token_only_tv"].combine_chunks().value_lengths().to_numpy(zero_copy_only=False)
        )
        # float32 holds the trace's float32 TVs and the 0/1 agreements exactly: half the
        # bytes of float64 for 2 x 25 values a round (_kind_row averages them in float64)
        tv = trace_matrix(t, "token_only_tv", np.nan, np.float32, _LIST)[0]
        agree = t["token_only_argmax_agree"].combine_chunks().cast(pa.list_(pa.float32()))
        return frame, tv, list_matrix(agree, np.nan, np.float32, _LIST)[0]

    def merge(self, part: tuple[pd.DataFrame, np.ndarray, np.ndarray]) -> None:
        frame, tv, agree = part
        self.frames.append(frame)
        self.tv.append(tv)
        self.agree.append(agree)

    def _joined(self) -> tuple[pd.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
        """All rounds, law by law (`rerank.evaluate.joined`: each law's rows a slice), with
        their predecessor's rebuild; token-only path mask [R, 25]. Takes the rounds added
        (the accumulator is empty after)."""
        if not self.frames:
            raise ValueError("the trace store holds no rounds")
        frame, order = law_ordered_frame(self.frames)
        tv, agree = joined_rows(self.tv, order), joined_rows(self.agree, order)
        codes = RoundCodes(frame[ROUND_KEYS])
        at = pd.Index(codes.encode(frame)).get_indexer(codes.encode(frame, shift=-1))
        split = (at >= 0) & (
            frame["n_list"].to_numpy()[np.maximum(at, 0)] == frame["n_token_only"].to_numpy()
        )
        bits = np.where(split, frame["path_bits"].to_numpy()[np.maximum(at, 0)], 0)
        # bit i of each round's mask as a bool column, unpacked from the mask's little-endian
        # bytes: shifting int64 masks by 25 held two [R, 25] int64 arrays (1.5 GB at 10x, by
        # count)
        mask_bytes = bits.astype("<u4").view(np.uint8).reshape(-1, 4)
        on_path = np.unpackbits(mask_bytes, axis=1, bitorder="little")[:, :_LIST].view(bool)
        return frame, tv, agree, np.concatenate([split[:, None], on_path], axis=1)


def _kind_row(present: np.ndarray, tv: np.ndarray, agree: np.ndarray, n_rounds: int) -> dict:
    """Availability over rounds, then TV / argmax agreement over the present rows (in
    float64, one copy at a time: a law's present TVs and agreements as float64 and the
    median's partition are each up to 25 values a round)."""
    has_row = present.any(axis=1) if present.ndim == 2 else present
    rows = tv[present]
    tv_mean, tv_median = _mean64(rows), _median64(rows)
    del rows
    return {
        "rounds": n_rounds,
        "availability": has_row.sum() / n_rounds,
        "rows": int(present.sum()),
        "rows_per_round": present.sum() / n_rounds,
        "tv_mean": tv_mean,
        "tv_median": tv_median,
        "argmax_agree": _mean64(agree[present]),
    }


def _mean64(values: np.ndarray) -> float:
    """``values.astype(np.float64).mean()`` (NaN when empty)."""
    return values.astype(np.float64).mean() if values.size else np.nan


def _median64(values: np.ndarray) -> float:
    """``np.median(values.astype(np.float64))`` (NaN when empty) from a partition of the
    values themselves: the cast keeps their order, and the middle values are averaged in
    float64 as `np.median` averages them."""
    n = values.size
    if n == 0 or np.isnan(values).any():
        return np.nan
    kth = [(n - 1) // 2, n // 2]  # one index when n is odd
    middle = np.partition(values, kth)[kth].astype(np.float64)
    return middle.mean() if n % 2 == 0 else middle[0]


def agreement_tables(rows: RowRounds) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(row agreement per law and row kind, match rates per law); columns in the module doc."""
    frame, tv, agree, split_path = rows._joined()
    split, on_path = split_path[:, 0], split_path[:, 1:]
    out, rates = [], []
    for t, m in law_spans(frame["temperature"].to_numpy()):  # a law's rows: slices, no copies
        n = m.stop - m.start
        law = law_name(t)
        listed = ~np.isnan(tv[m])
        kinds = {
            "token_only": listed,
            "token_only_path": listed & on_path[m] & split[m, None],
            "token_only_other": listed & ~on_path[m] & split[m, None],
        }
        for kind in AGREEMENT_ROWS:
            if kind in kinds:
                rec = _kind_row(kinds[kind], tv[m], agree[m], n)
            else:
                k_tv = frame[f"{kind}_tv"].to_numpy()[m]
                rec = _kind_row(~np.isnan(k_tv), k_tv, frame[f"{kind}_agree"].to_numpy()[m], n)
            out.append({"law": law, "row": kind, **rec})
        part = frame.iloc[m]
        rates.append(
            {
                "law": law,
                "rounds": n,
                "token_match_tree": float(((part["tree_ending"] > 0) | part["root_is_c"]).mean()),
                "token_match_scored": float(
                    ((part["scored_ending"] > 0) | part["root_is_c"]).mean()
                ),
                "address_match": float(part["covered"].mean()),
                "tree_prefixes_ending": float(part["tree_ending"].mean()),
                "scored_prefixes_ending": float(part["scored_ending"].mean()),
                "unsplit_rounds": int((~split[m] & (part["n_token_only"] > 0).to_numpy()).sum()),
            }
        )
    return pd.DataFrame(out), pd.DataFrame(rates)


def row_agreement(
    dataset: ds.Dataset, chunk_rounds: int = 8192
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`agreement_tables` of a trace store, read in chunks."""
    rows = RowRounds()
    for chunk in iter_pool_chunks(dataset, chunk_rounds, ROW_COLUMNS):
        rows.add(chunk)
    return agreement_tables(rows)
