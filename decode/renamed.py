"""Old entry-point names that run the renamed command (`python -m decode.pocket` is now
`python -m decode.train_pocket`): one line on stderr, then the new command with the same
arguments, as `python -m <new>` would run it."""

from __future__ import annotations

import runpy
import sys

# old module -> new module, for every renamed entry point
NEW_NAMES = {
    "decode.pocket": "decode.train_pocket",
    "decode.pocket.eagle3": "decode.train_pocket.eagle3",
    "decode.pocket.block": "decode.train_pocket.block",
    "decode.pocket.dspark": "decode.train_pocket.dspark",
    "decode.pocket.domino": "decode.train_pocket.domino",
    "decode.synth": "decode.synth_traces",
}


def notice(old: str) -> str:
    """The line an old name prints before it runs the new command."""
    return f"python -m {old} is now python -m {NEW_NAMES[old]}; the old name will be removed"


def run_renamed(old: str) -> None:
    """Run `python -m <old>` as its new name: the notice on stderr, then the new module as
    `__main__` with `sys.argv[1:]` unchanged."""
    print(notice(old), file=sys.stderr)
    runpy.run_module(NEW_NAMES[old], run_name="__main__", alter_sys=True)
