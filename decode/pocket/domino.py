"""`python -m decode.pocket.domino`: train and ship the pocket Domino drafter, its held-out tau
in its card (`recipes.pocket.domino`, `decode.pocket.semiar`)."""

from decode.pocket.semiar import main_domino
from specrank.cli import run_entry_point

if __name__ == "__main__":
    run_entry_point(main_domino, stage="decode.pocket.domino")
