"""`python -m specrank.log_run`: the old name of `python -m specrank.tracking.log_run` (log a finished run folder)."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("specrank.log_run")
