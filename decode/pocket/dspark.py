"""`python -m decode.pocket.dspark`: the old name of `python -m decode.train_pocket.dspark`."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.dspark")
