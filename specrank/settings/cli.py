"""Short command-line aliases for Hydra overrides (`traces=<dir>` for `features.traces=<dir>`).

Hydra only knows full paths into the schema; a few entry points document a
shorter form. Rewriting argv before `@hydra.main` parses it keeps Hydra's own
parsing (and its errors) for everything else. A refused setting or input
(`specrank.settings.errors.Refusal`) ends a command with its message and status 2, no trace.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

from specrank.settings.errors import Refusal
from specrank.settings.renames import renamed_message

REFUSED = 2  # exit status of a refused setting or input (argparse's for a bad argument)

_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextmanager
def refusals_exit() -> Iterator[None]:
    """A `Refusal` raised inside ends the process: `error: <message>` on stderr, status 2."""
    try:
        yield
    except Refusal as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(REFUSED)


def exits_on_refusal(task: Callable[_P, _R]) -> Callable[_P, _R]:
    """`task`, its refusals ending the process (`refusals_exit`). Put it under `@hydra.main`:
    Hydra prints the trace of any exception its task function raises, then exits 1, so the
    refusal must be caught before Hydra sees it. `SystemExit` is not an `Exception`: Hydra
    lets it through."""

    @functools.wraps(task)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with refusals_exit():
            return task(*args, **kwargs)

    return run


def expand_short_overrides(argv: list[str], aliases: Mapping[str, str]) -> list[str]:
    """Replace `alias=value` by `full.key=value` for the given aliases; leave the rest."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"{aliases[key]}={value}" if sep and key in aliases else arg)
    return out


def unknown_key_message(
    argv: list[str], schema: type, top: Collection[str] | None = None
) -> str | None:
    """A "Did you mean" message for the first `a.b=v` override whose key the schema lacks.

    Hydra's own error names the key but not the valid ones; difflib over the
    fields of the section the key points into supplies the closest. Group choices
    (`model=pocket`), appends (`+a.b=v`), deletions (`~a`) and `hydra.*` are left
    to Hydra. `top`: the sections a command reads (the suggestions for a first key).
    """
    import difflib

    from omegaconf import DictConfig, OmegaConf

    root = OmegaConf.structured(schema)
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or "." not in key or key.startswith(("-", "+", "~", "hydra")):
            continue
        node, seen = root, []
        for part in key.split("."):
            if not isinstance(node, DictConfig) or node._is_missing() or node._is_none():
                break  # a value (or an open dict): nothing more to check
            keys = list(node.keys())  # not `part in node`: that is False for MISSING values
            if not seen and top is not None:
                keys = [k for k in keys if k in top]
            if part not in keys:
                where = ".".join(seen) or "the config"
                close = difflib.get_close_matches(part, keys, n=3)
                hint = f" Did you mean {' or '.join(repr('.'.join([*seen, c])) for c in close)}?"
                valid = ", ".join(sorted(keys))
                return (
                    f"Key '{part}' is not in '{where}' (override {arg!r}).{hint if close else ''} "
                    f"Valid keys: {valid}"
                )
            node = node._get_node(part)
            seen.append(part)
    return None


# -- which command reads which section ------------------------------------------------------------

# The sections each command reads. Every command also takes `paths` (the folders every stage
# resolves), `seed` and `hydra`, and the global packages `debug=` and `experiment=`, which set
# every stage's sections: each command keeps the ones it reads.
READS: dict[str, tuple[str, ...]] = {
    "decode.record": ("model", "data", "pool", "select", "decode", "trace", "parallel"),
    "decode.run": ("model", "data", "pool", "select", "decode", "trace", "parallel", "run",
                   "mlflow"),
    "decode.synth_traces": ("synth", "synth_job", "pool", "select"),
    "features.extract": ("features",),
    "rerank.train": ("rerank", "mlflow", "parallel"),
    "rerank.transfer": ("rerank", "transfer", "mlflow"),
    "decode.train_pocket": ("pocket",),
    "decode.train_pocket.eagle3": ("pocket_eagle3",),
    "decode.train_pocket.block": ("pocket_block",),
    "decode.train_pocket.dspark": ("pocket_dspark",),
    "decode.train_pocket.domino": ("pocket_domino",),
    "decode.train_head": ("model", "head", "block_head"),
}  # fmt: skip
EVERY_COMMAND = ("paths", "seed", "hydra")
GLOBAL_PACKAGES = ("debug", "experiment")
# settings of a section a command reads that the command itself does not: what to set instead
NOT_READ = {"decode.run": {"select.rule": "run.rule"}}
# config groups and the section each fills
GROUP_SECTIONS = {"model": "model", "data": "data", "booster": "rerank", "launcher": "hydra"}
# `make run` passes one RUN_ARGS to every stage: each drops (and logs) what others read
ROUTED_ENV = "SPECRANK_ROUTED"


def _section(arg: str) -> tuple[str, str] | None:
    """(section, key) an override sets, or None for flags, `hydra.*` and global packages."""
    key, sep, _ = arg.partition("=")
    key = key.lstrip("+~")
    if not sep and not arg.startswith("~"):
        return None  # a flag (-m, --cfg ...)
    head = key.split(".")[0].split("@")[0]
    if head in GLOBAL_PACKAGES or head == "hydra":
        return None
    return (GROUP_SECTIONS.get(head, head) if "." not in key else head), key


def stage_override_message(stage: str, argv: list[str], known: set[str]) -> str | None:
    """Why `python -m <stage>` refuses an override of `argv`, or None.

    A section the command does not read (of `known`, the root schema's) is refused naming
    the commands that read it; a setting the command ignores names the one it reads instead.
    Unknown sections are left to `unknown_key_message`.
    """
    reads = {*READS[stage], *EVERY_COMMAND}
    for arg in argv:
        found = _section(arg)
        if found is None:
            continue
        section, key = found
        if key in NOT_READ.get(stage, {}):
            return (
                f"python -m {stage} does not read '{key}' (override {arg!r}). "
                f"Did you mean '{NOT_READ[stage][key]}'?"
            )
        if section in reads or section not in known:
            continue
        readers = [s for s, r in READS.items() if section in r]
        return (
            f"python -m {stage} does not read the '{section}' section (override {arg!r}): "
            f"it reads {', '.join(sorted(reads))}. '{section}' is read by "
            f"{', '.join(f'python -m {s}' for s in readers) or 'no command'}."
        )
    return None


def route(stage: str, argv: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """(kept, dropped): the overrides of `argv` for `stage`, and those for other commands."""
    reads = {*READS[stage], *EVERY_COMMAND}
    kept, dropped = [], []
    for arg in argv:
        found = _section(arg)
        other = found is not None and found[0] in known and found[0] not in reads
        ignored = found is not None and found[1] in NOT_READ.get(stage, {})
        (dropped if other or ignored else kept).append(arg)
    return kept, dropped


def run_entry_point(
    main: Callable[[], None], aliases: Mapping[str, str] | None = None, stage: str | None = None
) -> None:
    """`python -m <stage>`: expand short aliases, refuse overrides of sections the stage does
    not read (`READS`; under `make run`'s SPECRANK_ROUTED=1 they are left to the other
    stages) and unknown keys with suggestions, run. A refusal exits 2 with its message
    (`refusals_exit`); `main`'s task function needs `exits_on_refusal` for its own."""
    import gc

    with refusals_exit():
        sys.argv = [sys.argv[0], *checked_argv(sys.argv[1:], aliases or {}, stage)]
        # The imports' objects (modules, configs, classes) live as long as the process: frozen,
        # the collector's full passes skip them and traverse only the stage's own objects (the
        # default `rerank.train` ran 12 full passes, 2.6 CPU s, before).
        gc.freeze()
        main()


def checked_argv(argv: list[str], aliases: Mapping[str, str], stage: str | None) -> list[str]:
    """`argv` with short aliases expanded and (under SPECRANK_ROUTED) other stages' overrides
    dropped; a `Refusal` for an override the stage does not read or a key the schema lacks."""
    import dataclasses
    import os

    from specrank.settings.config import schema

    argv = expand_short_overrides(argv, aliases)
    for arg in argv:
        renamed = renamed_message(arg.partition("=")[0], arg)
        if renamed:
            raise Refusal(renamed)
    root = schema()
    top = None
    if stage is not None:
        known = {f.name for f in dataclasses.fields(root)}
        if os.environ.get(ROUTED_ENV):
            argv, dropped = route(stage, argv, known)
            if dropped:
                print(
                    f"python -m {stage}: for the other stages: {' '.join(dropped)}", file=sys.stderr
                )
        message = stage_override_message(stage, argv, known)
        if message:
            raise Refusal(message)
        top = {*READS[stage], *EVERY_COMMAND}
    message = unknown_key_message(argv, root, top)
    if message:
        raise Refusal(message)
    return argv
