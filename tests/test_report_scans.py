"""The report consumers' compiled scans equal the [R, P] torch passes they replaced, bit
for bit, on synthetic pools (`rerank.evaluate.row_agreement.next_round_lists`,
`rerank.evaluate.coverage.round_coverage`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from rerank.evaluate.coverage import round_coverage
from rerank.evaluate.pool_chunks import ROUND_KEYS, chunk_of, iter_trace_chunks
from rerank.evaluate.reports import ReportAccumulators
from rerank.evaluate.row_agreement import next_round_lists
from selection.pool_batch import POOL_COLUMNS, trace_matrix
from tree.retained import TOKEN_ONLY_MAX


def _lists_reference(chunk) -> dict[str, np.ndarray]:
    """next_round_lists as [R, P] torch masks and cumulative sums (the route it replaced)."""
    t, pool = chunk.table, chunk.pool
    width = pool.shape[1]
    c = torch.from_numpy(t["continuation_token"].to_numpy().astype(np.int64))[:, None]
    in_tree = torch.from_numpy(trace_matrix(t, "cand_in_tree", False, np.bool_, width)[0])
    path = torch.from_numpy(trace_matrix(t, "accepted_path", -1, np.int64)[0])
    n_acc = (path >= 0).sum(-1, keepdim=True)
    last = torch.gather(path, -1, (n_acc - 1).clamp(min=0)).where(n_acc > 0, -1)
    on_path = torch.zeros(pool.shape[0], width + 1, dtype=torch.bool)
    on_path = on_path.scatter_(-1, torch.where(path >= 0, path, width), True)[:, :width]
    ends_c = (pool.token == c) & pool.valid
    others = ends_c & chunk.scored & ~(ends_c & (pool.parent == last))
    root_is_c = torch.from_numpy(t["root_token"].to_numpy().astype(np.int64))[:, None] == c
    pos = torch.cumsum(others.long(), -1) - 1 + root_is_c.long()
    listed = others & (pos < TOKEN_ONLY_MAX + root_is_c.long())
    bits = torch.where(listed & on_path, torch.ones_like(pos) << pos.clamp(min=0), 0).sum(-1)
    return {
        "path_bits": (bits | root_is_c[:, 0].long()).numpy(),
        "n_list": (listed.sum(-1) + root_is_c[:, 0].long()).numpy(),
        "tree_ending": (ends_c & in_tree).sum(-1).numpy(),
        "scored_ending": (ends_c & chunk.scored).sum(-1).numpy(),
        "root_is_c": root_is_c[:, 0].numpy(),
    }


def test_next_round_lists_scan_equals_the_mask_route(fast_traces):
    columns = sorted({*ReportAccumulators([1]).columns, *POOL_COLUMNS, *ROUND_KEYS})
    table = next(iter_trace_chunks(fast_traces, 200, columns))
    rng = np.random.default_rng(0)
    # continuations that many prefixes end in: a pool token of each round, some the root's
    tokens = trace_matrix(table, "cand_token", 0, np.int64)[0]
    cont = tokens[np.arange(len(table)), rng.integers(0, 4, len(table))]
    root = np.where(rng.random(len(table)) < 0.3, cont, table["root_token"].to_numpy())
    # and in a third of the rounds half the pool ends in it: lists that reach their cap
    lists = table["cand_token"].combine_chunks()
    values = lists.values.to_numpy().copy()
    row = np.repeat(np.arange(len(table)), np.diff(lists.offsets.to_numpy()))
    crowd = (row % 3 == 0) & (rng.random(values.size) < 0.5)
    values[crowd] = cont[row[crowd]]
    table = table.set_column(table.schema.get_field_index("cand_token"), "cand_token",
                             pa.ListArray.from_arrays(lists.offsets, pa.array(values, pa.int32())))  # fmt: skip
    flags = table["cand_scored"].combine_chunks()  # scored, so that they are listed
    scored = flags.values.to_numpy(zero_copy_only=False) | crowd
    table = table.set_column(table.schema.get_field_index("cand_scored"), "cand_scored",
                             pa.ListArray.from_arrays(flags.offsets, pa.array(scored)))  # fmt: skip
    table = table.set_column(table.schema.get_field_index("continuation_token"),
                             "continuation_token", pa.array(cont, pa.int32()))  # fmt: skip
    table = table.set_column(table.schema.get_field_index("root_token"), "root_token",
                             pa.array(root, table.schema.field("root_token").type))  # fmt: skip
    chunk = chunk_of(table)
    got, want = next_round_lists(chunk), _lists_reference(chunk)
    assert (want["n_list"] == TOKEN_ONLY_MAX + want["root_is_c"]).any()  # lists at their cap
    assert (want["path_bits"] > 1).any()  # path entries past the root
    for name, w in want.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)


def _coverage_reference(chunk, budget, top_ms, frontier_ks) -> dict:
    """round_coverage as [R, P] torch passes (the route `_prefix_sets` replaced)."""

    def at(curve, count):
        idx = (count - 1).clamp(0, curve.shape[-1] - 1)
        return torch.where(count > 0, torch.gather(curve, -1, idx[:, None])[:, 0], 0.0)

    pool, order, rank = chunk.pool, chunk.order, chunk.rank
    valid = pool.valid
    in_tree = (rank < budget) & valid
    parent_in = torch.gather(in_tree, -1, pool.parent.clamp(min=0))
    frontier = valid & ~in_tree & ((pool.parent < 0) | parent_in)
    front_o = torch.gather(frontier, -1, order)
    cum_mass = torch.cumsum(torch.where(front_o, chunk.path_prob_ordered, 0.0), -1)
    cum_front = torch.cumsum(front_o, -1, dtype=torch.int32)
    n_valid = valid.sum(-1)
    n_tree = n_valid.clamp(max=budget)
    n_front = cum_front[:, -1].long()
    out = {"tree": (at(cum_mass, n_tree), n_tree - n_tree, at(cum_front, n_tree))}
    for m in top_ms:
        n_top = n_valid.clamp(max=max(m, budget))
        out[f"top{m}"] = (at(cum_mass, n_top), n_top - n_tree, at(cum_front, n_top))
    scored_front = frontier & chunk.scored
    out["recorded"] = (torch.where(scored_front, chunk.ctx.path_prob, 0.0).sum(-1),
                       (chunk.scored & valid & ~in_tree).sum(-1), scored_front.sum(-1))  # fmt: skip
    out["pool"] = (cum_mass[:, -1], n_valid - n_tree, n_front)
    for k in frontier_ks:
        upto = torch.searchsorted(cum_front, torch.full((len(n_valid), 1), k, dtype=torch.int32))
        n_k = n_front.clamp(max=k)
        out[f"frontier{k}"] = (at(cum_mass, upto[:, 0] + 1), n_k, n_k)
    out["frontier"] = (cum_mass[:, -1], n_front, n_front)
    return {name: tuple(v.double().numpy() for v in vals) for name, vals in out.items()}


@pytest.mark.parametrize("budget", [1, 4, 8, 40])
def test_coverage_scan_equals_the_torch_passes(fast_traces, budget):
    columns = sorted({*ReportAccumulators([1]).columns, *POOL_COLUMNS, *ROUND_KEYS})
    chunk = chunk_of(next(iter_trace_chunks(fast_traces, 200, columns)))
    got = round_coverage(chunk, budget, [2, 8, 100], [1, 5, 40])
    want = _coverage_reference(chunk, budget, [2, 8, 100], [1, 5, 40])
    assert list(got) == list(want)
    assert (want["frontier5"][0] > 0).any()  # sets that cover something
    for name, w in want.items():
        for i, what in enumerate(("coverage", "extra", "frontier")):
            np.testing.assert_array_equal(got[name][i], w[i], err_msg=f"{name} {what}")
