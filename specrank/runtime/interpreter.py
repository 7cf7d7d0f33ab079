"""Entry points run by the project's interpreter, also when called with another `python`.

`make setup` installs the project and its dependencies into `.venv`. A command of the README
typed without that environment active (`python -m decode.record --cfg job`, with the
machine's own `python` first on PATH) ran an interpreter without Hydra and failed with a
bare ModuleNotFoundError inside the entry point's imports. Each entry package (`decode`,
`features`, `rerank`, `specrank`, `recipes`, `bench`) calls `use_project_interpreter` first:
where this interpreter lacks a dependency and the project's `.venv` exists, a `python -m ...`
command is run again by `.venv/bin/python`, saying so on stderr; otherwise the import fails
naming the missing modules and the remedy. Standard library only: it runs before any
dependency is importable.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from specrank.settings.paths import PROJECT_ROOT  # standard library only, as this module

VENV = PROJECT_ROOT / ".venv"
# What every entry point imports first (pyproject.toml's dependencies)
REQUIRED = ("hydra", "omegaconf", "numpy", "pyarrow")


def missing_modules() -> list[str]:
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


def module_command(orig_argv: list[str]) -> list[str] | None:
    """`-m <module> <args...>` of an interpreter's command line, None if it ran no module
    (a script, `-c`, or nothing).

    Interpreter options before `-m` (`-S`, `-X dev`) are left out: the rerun gets the
    environment's defaults. A `-m` after a script's path is the script's own argument."""
    args, i = orig_argv[1:], 0
    while i < len(args):
        arg = args[i]
        if arg == "-m":
            return args[i:] if i + 1 < len(args) else None
        if arg in ("-X", "-W"):  # the options that take a separate value
            i += 2
        elif arg.startswith("-") and arg not in ("-", "-c"):
            i += 1
        else:  # a script, `-c` or stdin: no module
            return None
    return None


def use_project_interpreter(venv: Path = VENV) -> None:
    """Nothing where the dependencies import; else rerun a `python -m` command in `venv`, or
    raise ImportError naming what is missing and how to get it."""
    missing = missing_modules()
    if not missing:
        return
    python = venv / "bin" / "python"
    command = module_command(list(getattr(sys, "orig_argv", [])))
    inside = Path(sys.prefix).resolve() == venv.resolve()
    if command is not None and python.exists() and not inside:
        print(f"specrank: {sys.executable} lacks {', '.join(missing)}; running the command "
              f"with {python} (made by `make setup`; `source .venv/bin/activate` uses it "
              f"directly)", file=sys.stderr, flush=True)  # fmt: skip
        os.execv(python, [str(python), *command])
    raise ImportError(
        f"specrank: this interpreter ({sys.executable}) lacks {', '.join(missing)}. Run "
        f"`make setup` in {PROJECT_ROOT} (it creates .venv), then `source .venv/bin/activate` "
        f"or call .venv/bin/python"
    )
