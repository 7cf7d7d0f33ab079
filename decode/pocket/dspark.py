"""`python -m decode.pocket.dspark`: the old name of `python -m decode.train_pocket.dspark`."""

from decode.renamed import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.dspark")
