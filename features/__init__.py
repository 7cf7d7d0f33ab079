"""First-level candidate features (docs/method.md#features), shared by offline training and the online decoder.

rounds.RoundArrays            pre-verification inputs of R rounds (`one_round` for R = 1)
first_level.first_level_features(rounds) -> {name: [N] array}   the feature functions
first_level.first_level_labels(...)      -> {name: [N] array}   labels (from verification)
from_trace.candidate_table(trace) -> pa.Table                    a trace shard -> candidate rows
schema.CANDIDATE_SPEC / candidate_store(root)                    the candidate table, versioned
extract.extract(traces, out)                                     `python -m features.extract`
"""

from specrank.runtime.interpreter import use_project_interpreter

use_project_interpreter()  # a `python -m` command outside .venv reruns in it (specrank.runtime.interpreter)
