"""`python -m decode.pocket.eagle3`: the old name of `python -m decode.train_pocket.eagle3`."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.eagle3")
