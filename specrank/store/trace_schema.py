"""Trace schema v4: one Arrow row per decoding round.

This is the contract between the decoder (`decode.record`, `recipes.synth`) and
everything downstream (`features.extract`, `rerank.train`). Change a column and
you must bump `SCHEMA_VERSION`; readers refuse other versions.

Versions: v2 adds `category`, the prompt's fine category (Spec-Bench's category,
"humaneval", a JSONL record's own label; `pairs.prompts`) beside `task`, which is
now the prompt source's mapped task (the paper's seven, docs/method.md#reporting). v1 stores hold
no category and are refused: record them again. v3 adds what the rows hold beyond
the paper's three first-level columns, all known before verification: the matched
row at the first-level candidates (`fl_matched_logprob`), the token-only rows
aggregated there (mean and max log-prob) with each one's argmax, and every
role row's entropy, top-1 mass and argmax. v2 stores are refused: record them again.
v4 adds `draft_confidence`, the drafter's own estimate of the acceptance of its top
first-level candidate, known before verification: DSpark's calibrated confidence of block
row 1 (`pairs.semiar.drafter.SemiARDrafter.grow`), null for every drafter kind without a
confidence head (eagle3, block, domino, standalone, synthetic traces). v3 stores read as v4
(`TRACE_MIGRATIONS`: the store's one migration, in `specrank.store.shard_store`), the new
column all null; they are not written into (record a new folder), and no store mixes v3 and
v4 shards.

Pool layout (docs/method.md#pool). The `cand_*` list columns have one entry per pool
candidate (P = 710 by default), in *pool order*: depths are non-decreasing and
every parent precedes its children, so the first-level candidates are the
first `n1` entries (those with depth 1) and pool index order equals the ranking
tie-break (docs/method.md#ranking: depth asc, then pool index asc). `cand_parent` is -1 for children
of the root.

Target probabilities. `cand_target_prob[i]` is p(token_i | prefix of parent_i)
under the decoding temperature T (softmax of logits / T). At T = 0 the law is
a point mass on the argmax; there the column holds the unit-temperature softmax
(the "softmax-probability variant" of docs/method.md#rule-values) and the greedy law is given
exactly by `cand_target_argmax` / `root_argmax`.

Retained rows (docs/method.md#retained-rows) are rows kept from the *previous* round; the `fl_*`
columns evaluate them at *this* round's first-level candidates (aligned with
the first n1 pool entries), and the `*_tv` / `*_argmax_agree` columns compare
them with *this* round's root row. Absent rows are null, never 0.

Nulls. Each field, and each list column's items, say whether they may be null:
only the `fl_*` items (an absent retained row at a candidate) and the scalar
retained-row columns may. Writers (`TableSpec.conform`) and every reader of the
pool and outcome lists (`selection.pool_batch.trace_matrix`) refuse a null
anywhere else, naming the column and the row; v3 stores written before the item
declarations read the same (their values are unchanged). `draft_confidence` may be null.
"""

from __future__ import annotations

import pyarrow as pa

from specrank.store.shard_store import ShardStore
from specrank.store.tables import Migration, TableSpec

SCHEMA_VERSION = 4

_f32 = pa.float32()
_i32 = pa.int32()


def _items(type_: pa.DataType, nullable: bool = False) -> pa.DataType:
    """A list type whose items may be null only where declared (readers refuse other nulls)."""
    return pa.list_(pa.field("item", type_, nullable=nullable))


TRACE_SCHEMA = pa.schema(
    [
        # -- round identity and context ------------------------------------------
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("task", pa.string(), nullable=False),  # what weighting/resampling group by
        pa.field("category", pa.string(), nullable=False),  # finer label, for breakdowns
        pa.field("round_index", _i32, nullable=False),  # 0-based within the prompt
        pa.field("tokens_before", _i32, nullable=False),  # tokens emitted before this round
        pa.field("prompt_length", _i32, nullable=False),  # in tokens
        pa.field("temperature", _f32, nullable=False),  # 0 = greedy
        pa.field("rule", pa.string(), nullable=False),  # rule that chose the verified tree
        pa.field("budget", _i32, nullable=False),  # B: non-root nodes of the verified tree
        pa.field("root_token", _i32, nullable=False),
        # -- pool, one entry per candidate (pool order) ----------------------------
        pa.field("cand_token", _items(_i32), nullable=False),
        pa.field("cand_parent", _items(pa.int16()), nullable=False),  # -1 = root
        pa.field("cand_depth", _items(pa.int8()), nullable=False),  # 1..8
        pa.field("cand_draft_logprob", _items(_f32), nullable=False),  # per-edge log q, float32
        pa.field("cand_expanded", _items(pa.bool_()), nullable=False),
        # per-edge p under T (T=1 at T=0)
        pa.field("cand_target_prob", _items(_f32), nullable=False),
        pa.field("cand_scored", _items(pa.bool_()), nullable=False),  # prefix scored by the pass
        pa.field("cand_in_tree", _items(pa.bool_()), nullable=False),  # in the verified tree
        # argmax at prefix; -1 unscored
        pa.field("cand_target_argmax", _items(_i32), nullable=False),
        # -- root row -------------------------------------------------------------
        pa.field("root_argmax", _i32, nullable=False),
        # nats, of the row at temperature T (T=1 at T=0)
        pa.field("root_entropy", _f32, nullable=False),
        pa.field("root_top1_prob", _f32, nullable=False),
        # -- outcome --------------------------------------------------------------
        # pool indices, depth order
        pa.field("accepted_path", _items(pa.int16()), nullable=False),
        pa.field("continuation_token", _i32, nullable=False),
        pa.field("covered", pa.bool_(), nullable=False),  # emitted address lies in the scored set
        # -- retained rows at this round's first-level candidates (docs/method.md#retained-rows, #features) ------
        pa.field(
            "fl_cache_logprob", _items(_f32, nullable=True), nullable=False
        ),  # elements nullable
        pa.field("fl_same_logprob", _items(_f32, nullable=True), nullable=False),
        pa.field(
            "fl_prev_logprob", _items(_f32, nullable=True), nullable=False
        ),  # root-token entry always null
        pa.field(
            "fl_matched_logprob", _items(_f32, nullable=True), nullable=False
        ),  # null: not covered
        # token-only rows at each candidate: mean / max log-prob (null without such rows)
        pa.field("fl_token_only_mean_logprob", _items(_f32, nullable=True), nullable=False),
        pa.field("fl_token_only_max_logprob", _items(_f32, nullable=True), nullable=False),
        pa.field("token_only_argmax", _items(_i32), nullable=False),  # per token-only row
        pa.field("cache_age", _i32),  # rounds since the cache row was stored; null if absent
        pa.field("prev_tree_root_count", _i32),  # previous-tree prefixes ending in the root token
        # -- each role row on its own (null when absent; preceding: continuation zeroed) --
        *[
            pa.field(f"{kind}_{stat}", type_)
            for kind in ("cache", "same", "prev", "matched")
            for stat, type_ in (("entropy", _f32), ("top1_prob", _f32), ("argmax", _i32))
        ],
        # -- agreement of each retained row with this round's root row --------------
        pa.field("cache_tv", _f32),
        pa.field("cache_argmax_agree", pa.bool_()),
        pa.field("same_tv", _f32),
        pa.field("same_argmax_agree", pa.bool_()),
        pa.field("prev_tv", _f32),
        pa.field("prev_argmax_agree", pa.bool_()),
        pa.field("matched_tv", _f32),
        pa.field("matched_argmax_agree", pa.bool_()),
        pa.field("token_only_tv", _items(_f32), nullable=False),  # up to 24 rows, pool order
        pa.field("token_only_argmax_agree", _items(pa.bool_()), nullable=False),
        # -- per-stage timings (milliseconds; 0 for synthetic traces) -------------------
        pa.field("time_draft_ms", _f32, nullable=False),
        pa.field("time_select_ms", _f32, nullable=False),
        pa.field("time_verify_ms", _f32, nullable=False),
        pa.field("time_bookkeeping_ms", _f32, nullable=False),
        # -- the drafter's own acceptance estimate of its top first-level candidate (v4) ----
        # DSpark: sigmoid(z_1 / T_1), z_1 its confidence head's logit of block row 1 (the
        # block's first draft token), T_1 the card's fitted STS temperature of that position
        # (1 without one); null for every kind without a confidence head
        pa.field("draft_confidence", _f32, nullable=True),
    ]
)

# v3 stores read as v4, the drafter's estimate absent (null)
TRACE_MIGRATIONS = (Migration(3, ("draft_confidence",)),)
TRACE_SPEC = TableSpec(name="trace", version=SCHEMA_VERSION, schema=TRACE_SCHEMA,
                       migrations=TRACE_MIGRATIONS)  # fmt: skip


def trace_store(root) -> ShardStore:
    """The shard store of a trace folder (writer and reader)."""
    return ShardStore(root, TRACE_SPEC)
