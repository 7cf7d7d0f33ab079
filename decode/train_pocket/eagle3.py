"""`python -m decode.train_pocket.eagle3`: train and ship the pocket EAGLE-3 head
(`recipes.pocket.eagle3`)."""

from recipes.pocket.eagle3 import main
from specrank.settings.cli import run_entry_point

if __name__ == "__main__":
    run_entry_point(main, stage="decode.train_pocket.eagle3")
