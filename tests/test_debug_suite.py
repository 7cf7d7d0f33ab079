"""`debug=default` end to end: `decode.synth_traces`, then `features.extract` on its traces, then
`rerank.train` on both, each as `python -m` runs it from another folder (`decode.synth_traces`'s
`@hydra.main` lives in `recipes.synth.job`), every output in a temporary folder.

The debug suite must hold enough prompts for the default training settings (the token
prior's prompt alternation needs two prompts in each half's training prompts at each
temperature); a suite too small for them ends the third command, after the other two.
"""

from __future__ import annotations

import os
import subprocess
import sys

from specrank.settings.cli import ROUTED_ENV
from specrank.store.trace_schema import trace_store


def test_the_debug_suite_synthesizes_extracts_and_trains(tmp_path):
    stores = [f"paths.traces={tmp_path}/t", f"paths.features={tmp_path}/f"]
    stages = {
        "decode.synth_traces": [f"paths.synthetic={tmp_path}/t"],
        "features.extract": stores,
        "rerank.train": [*stores, f"mlflow.tracking_uri=sqlite:///{tmp_path}/ml.db"],
    }
    env = {k: v for k, v in os.environ.items() if k != ROUTED_ENV}
    for stage, args in stages.items():
        argv = [sys.executable, "-m", stage, "debug=default", *args,
                f"hydra.run.dir={tmp_path}/{stage}"]  # fmt: skip
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)  # fmt: skip
        assert done.returncode == 0, f"{stage}:\n{done.stderr[-3000:]}"
        if stage == "decode.synth_traces":  # debug: 8 prompts x 5 rounds
            assert trace_store(tmp_path / "t").read(columns=["prompt_id"]).num_rows == 8 * 5
    assert (tmp_path / "rerank.train" / "summary.csv").is_file()
