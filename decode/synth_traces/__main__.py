"""`python -m decode.synth_traces`: synthetic traces (see `recipes.synth.job`)."""

from recipes.synth.job import main
from specrank.settings.cli import run_entry_point

run_entry_point(main, stage="decode.synth_traces")
