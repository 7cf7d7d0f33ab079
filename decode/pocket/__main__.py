"""`python -m decode.pocket`: the old name of `python -m decode.train_pocket`."""

from specrank.settings.renames import run_renamed

run_renamed("decode.pocket")
