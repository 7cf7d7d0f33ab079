"""The candidate table: one row per first-level candidate per round (schema v2).

Keys join a row back to its round (prompt_id, temperature, rule, budget,
round_index) and name the candidate (cand_index = pool index, token). Then
every docs/method.md#features feature, then the labels. Missing features are null, never 0.
The token prior is not stored: it depends on the training half and is
computed inside each cross-fitting fold (`rerank`).

Change a column and bump `CANDIDATE_VERSION`; readers refuse other versions.
v2 adds the row features beyond the paper (the `rows_extra` set) and the matched
and token-only rows (`rows_matched`), from trace schema v3. The feature columns, their
types and nullability come from `features.registry`.
"""

from __future__ import annotations

import pyarrow as pa

from features.registry import FEATURES
from specrank.store.shard_store import ShardStore
from specrank.store.tables import TableSpec

CANDIDATE_VERSION = 2

_f32 = pa.float32()
_i32 = pa.int32()

_KEYS = {
    "prompt_id": pa.string(),
    "task": pa.string(),  # also a (categorical) feature
    "temperature": _f32,  # 0 = greedy
    "rule": pa.string(),  # rule that chose the recorded verified tree
    "budget": _i32,
    "round_index": _i32,  # also a feature: the round's position
    "cand_index": pa.int16(),  # pool index = position among the first-level candidates
    "token": _i32,
}
_LABELS = {"label_target_prob": _f32, "label_is_argmax": pa.bool_()}  # never features
KEY_COLUMNS = list(_KEYS)
LABEL_COLUMNS = list(_LABELS)

# keys, then every feature of features.registry in its order (null where missing), then labels
CANDIDATE_SCHEMA = pa.schema(
    [
        *(pa.field(n, t, nullable=False) for n, t in _KEYS.items()),
        *(pa.field(f.name, f.arrow_type, nullable=f.nullable) for f in FEATURES
          if f.name not in KEY_COLUMNS),
        *(pa.field(n, t, nullable=False) for n, t in _LABELS.items()),
    ]
)  # fmt: skip

CANDIDATE_SPEC = TableSpec(name="candidates", version=CANDIDATE_VERSION, schema=CANDIDATE_SCHEMA)


def candidate_store(root) -> ShardStore:
    """The shard store of a candidate-table folder (writer and reader)."""
    return ShardStore(root, CANDIDATE_SPEC)
