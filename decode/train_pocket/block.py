"""`python -m decode.train_pocket.block`: train and ship the pocket block drafter
(`recipes.pocket.block`)."""

from recipes.pocket.block import main
from specrank.settings.cli import run_entry_point

if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_pocket.block")
