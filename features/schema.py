"""The candidate table: one row per first-level candidate per round (schema v2).

Keys join a row back to its round (prompt_id, temperature, rule, budget,
round_index) and name the candidate (cand_index = pool index, token). Then
every SPEC §7 feature, then the labels. Missing features are null, never 0.
The token prior is not stored: it depends on the training half and is
computed inside each cross-fitting fold (`rerank`).

Change a column and bump `CANDIDATE_VERSION`; readers refuse other versions.
v2 adds the row features beyond the paper (EXTRA_ROW_FEATURES) and the matched
and token-only rows (MATCHED_FEATURES), from trace schema v3.
"""

from __future__ import annotations

import pyarrow as pa

from specrank.shard_store import ShardStore
from specrank.tables import TableSpec

CANDIDATE_VERSION = 2

_f32 = pa.float32()
_i32 = pa.int32()


def _req(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


def _opt(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=True)


CANDIDATE_SCHEMA = pa.schema(
    [
        # -- keys ----------------------------------------------------------------------
        _req("prompt_id", pa.string()),
        _req("task", pa.string()),  # also a (categorical) feature
        _req("temperature", _f32),  # 0 = greedy
        _req("rule", pa.string()),  # rule that chose the recorded verified tree
        _req("budget", _i32),
        _req("round_index", _i32),  # also a feature: the round's position
        _req("cand_index", pa.int16()),  # pool index = position among the first-level candidates
        _req("token", _i32),
        # -- draft probability among the siblings ----------------------------------------
        _req("draft_logprob", _f32),
        _req("draft_prob", _f32),
        _req("draft_rank", _i32),
        _req("draft_prob_share", _f32),
        _opt("top_sibling_prob", _f32),
        _opt("margin_top_sibling", _f32),
        _opt("gap_above", _f32),
        _opt("gap_below", _f32),
        _req("sibling_mass", _f32),
        # -- draft distribution at the root --------------------------------------------------
        _req("n_first_level", _i32),
        _req("fl_draft_mass", _f32),
        _req("root_draft_entropy", _f32),
        _req("root_draft_top1", _f32),
        # -- pool subtree below the candidate ------------------------------------------------
        _req("expanded", pa.bool_()),
        _req("subtree_size", _i32),
        _req("subtree_depth", _i32),
        _opt("subtree_best_d2", _f32),
        _opt("subtree_best_deepest", _f32),
        _req("subtree_draft_mass", _f32),
        _opt("subtree_draft_mass_rel", _f32),
        # -- context --------------------------------------------------------------------------
        _req("prompt_length", _i32),
        _req("tokens_before", _i32),
        _opt("prev_accepted", _i32),  # null at round 0
        _req("repeats_root", pa.bool_()),
        # -- retained rows (null where the row is absent) -------------------------------------
        _opt("cache_logprob", _f32),
        _opt("cache_gap", _f32),
        _opt("same_logprob", _f32),
        _opt("same_gap", _f32),
        _opt("prev_logprob", _f32),  # always null for the candidate repeating the root token
        _opt("prev_gap", _f32),
        _opt("cache_age", _i32),
        _opt("prev_tree_root_count", _i32),
        # -- retained rows beyond the paper (null where the row is absent) ---------------------
        *[
            _opt(f"{kind}_{stat}", _f32)
            for kind in ("cache", "same", "prev")
            for stat in ("rank", "entropy", "top1", "top_is_draft_top")
        ],
        _opt("matched_logprob", _f32),  # null: the previous round was not covered
        _opt("matched_gap", _f32),
        _opt("matched_rank", _f32),
        _opt("matched_entropy", _f32),
        _opt("matched_top1", _f32),
        _opt("matched_top_is_draft_top", _f32),
        _req("token_only_count", _i32),
        _opt("token_only_mean_logprob", _f32),
        _opt("token_only_max_logprob", _f32),
        _opt("token_only_top_agree", _f32),
        # -- labels (from verification: never features) ---------------------------------------
        _req("label_target_prob", _f32),
        _req("label_is_argmax", pa.bool_()),
    ]
)

CANDIDATE_SPEC = TableSpec(name="candidates", version=CANDIDATE_VERSION, schema=CANDIDATE_SCHEMA)

KEY_COLUMNS = [
    "prompt_id",
    "task",
    "temperature",
    "rule",
    "budget",
    "round_index",
    "cand_index",
    "token",
]
ROW_FEATURES = [
    "cache_logprob",
    "cache_gap",
    "same_logprob",
    "same_gap",
    "prev_logprob",
    "prev_gap",
    "cache_age",
    "prev_tree_root_count",
]
# Beyond the paper: the rank under each of its rows, each row's shape, argmax vs the drafter.
EXTRA_ROW_FEATURES = [
    f"{kind}_{stat}"
    for kind in ("cache", "same", "prev")
    for stat in ("rank", "entropy", "top1", "top_is_draft_top")
]
# The matched row (known before verification after a covered round) and the token-only rows.
MATCHED_FEATURES = [
    "matched_logprob",
    "matched_gap",
    "matched_rank",
    "matched_entropy",
    "matched_top1",
    "matched_top_is_draft_top",
    "token_only_count",
    "token_only_mean_logprob",
    "token_only_max_logprob",
    "token_only_top_agree",
]
LABEL_COLUMNS = ["label_target_prob", "label_is_argmax"]
_ROWS_ALL = ROW_FEATURES + EXTRA_ROW_FEATURES + MATCHED_FEATURES
# "Base" reranker inputs (SPEC §8): everything known before verification except the rows.
BASE_FEATURES = ["task", "round_index"] + [
    n for n in CANDIDATE_SCHEMA.names if n not in KEY_COLUMNS + _ROWS_ALL + LABEL_COLUMNS
]


def candidate_store(root) -> ShardStore:
    """The shard store of a candidate-table folder (writer and reader)."""
    return ShardStore(root, CANDIDATE_SPEC)
