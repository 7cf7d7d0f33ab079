"""`python -m decode.synth`: synthetic traces (see `decode.synth.job`)."""

from decode.synth.job import main
from specrank.cli import run_entry_point

run_entry_point(main)
