"""Scored-set policies: what a round's target pass scores beside its verified tree, in the
paper's words (one vocabulary for recording, offline evaluation and online decoding).

  tree      nothing else (Q = T): never covered (Theorem 1)
  top_m     the M highest-ranked candidates outside T, in the rule's own order (App. D.10)
  frontier  every candidate outside T whose parent is in T or is the root (Table 21)
  record    the recording pass's set: expanded nodes and the draft top `select.record_top_m`
  pool      every candidate
"""

from __future__ import annotations

SCORE_MODES = ("tree", "top_m", "frontier", "record", "pool")
# the policies that give every pool edge's target probability (traces, offline values)
EDGE_MODES = ("record", "pool")
# The policies under which a decoder keeps no token-only rows (docs/method.md#retained-rows): all but `record`.
# A token-only row is any scored prefix ending in the continuation, so the rows a decoder holds
# depend on every prefix its pass scores, and the trace keeps the recording's only aggregated:
# offline can rebuild no other set's. So the rows are dropped online (and in recordings under
# these policies) and their features masked offline (rerank.evaluate.policy.for_policy), and a
# model is fitted on the inputs it is decoded with.
NO_TOKEN_ONLY = ("tree", "top_m", "frontier", "pool")
# The policies under which the matched row follows the decoder's own trees, which offline
# simulates round by round (rerank.evaluate.matched); under `record` it is the recording's,
# under `tree` there is none (Theorem 1).
SIMULATED = ("top_m", "frontier", "pool")
