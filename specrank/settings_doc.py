"""`python -m specrank.settings_doc`: the old name of `python -m specrank.settings.settings_doc` (the settings page)."""

from specrank.settings.renames import run_renamed

if __name__ == "__main__":
    run_renamed("specrank.settings_doc")
