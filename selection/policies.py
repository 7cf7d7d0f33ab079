"""Scored-set policies: what a round's target pass scores beside its verified tree, in the
paper's words (one vocabulary for recording, offline evaluation and online decoding).

  tree      nothing else (Q = T): never covered (Theorem 1)
  top_m     the M highest-ranked candidates outside T, in the rule's own order (App. D.10)
  frontier  every candidate outside T whose parent is in T or is the root (Table 21)
  record    the recording pass's set: expanded nodes and the draft top `select.top_m`
  pool      every candidate
"""

from __future__ import annotations

SCORE_MODES = ("tree", "top_m", "frontier", "record", "pool")
# the policies that give every pool edge's target probability (traces, offline values)
EDGE_MODES = ("record", "pool")
# The policies under which a decoder keeps no token-only rows (SPEC §5). Under `tree` the
# recording's token-only rows come from prefixes the decoder never scores, and the trace
# keeps them only aggregated, so offline cannot rebuild the tree's own subset: the rows are
# dropped online and their features masked offline (rerank.evaluate.policy.for_policy), so
# a model is fitted on the inputs it is decoded with.
NO_TOKEN_ONLY = ("tree",)
