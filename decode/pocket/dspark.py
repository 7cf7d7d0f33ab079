"""`python -m decode.pocket.dspark`: train, calibrate and ship the pocket DSpark drafter, its
held-out tau in its card (`recipes.pocket.dspark`, `decode.pocket.semiar`)."""

from decode.pocket.semiar import main_dspark
from specrank.cli import run_entry_point

if __name__ == "__main__":
    run_entry_point(main_dspark, stage="decode.pocket.dspark")
