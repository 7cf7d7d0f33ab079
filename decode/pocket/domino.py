"""`python -m decode.pocket.domino`: the old name of `python -m decode.train_pocket.domino`."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.domino")
