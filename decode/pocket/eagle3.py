"""`python -m decode.pocket.eagle3`: the old name of `python -m decode.train_pocket.eagle3`."""

from decode.renamed import run_renamed

if __name__ == "__main__":
    run_renamed("decode.pocket.eagle3")
