"""`python -m decode.pocket`: the old name of `python -m decode.train_pocket`."""

from decode.renamed import run_renamed

run_renamed("decode.pocket")
