"""`python -m decode.pocket.block`: the old name of `python -m decode.train_pocket.block`."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.block")
