"""`python -m decode.synth`: the old name of `python -m decode.synth_traces`."""

from specrank.settings.renames import run_renamed

run_renamed("decode.synth")
