"""Every command line the README shows, and a driver that checks them in one process.

`readme_commands()` collects the command lines of the README's ```bash blocks and of its
inline code spans (`python -m ...`, `make ...`, a shell loop of them), with `\\`
continuations joined and comments cut. A block after `<!-- commands: exempt (why) -->`
is exempt (it needs a browser, CUDA for real, a cluster, ...): the test lists those.

`check(cmd)` turns one line into what the test runs, without the minutes a real run takes:
- a Hydra entry point: the same `python -m` with `--cfg job` (the config composed, every
  override checked; `-m` sweeps expanded to one composition per value, as Hydra's
  `--cfg` refuses multirun);
- an argparse script (`bench.*`): its real arguments parsed, then stopped before it runs;
- `make`: `make -n` (the recipe printed, not run), `make help` for real.
Placeholders (`<dir>`, `/path/to/...`) become folders under a temporary root.
`python tests/readme_commands.py` reads the commands as JSON on stdin and runs the Python
ones with `runpy`, as `python -m` does, one after the other in this one process.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the README, the measurement logs it links to and the docs pages, whose command lines are
# checked alike
DOCS = (README, ROOT / "bench" / "SCALING.md", *sorted((ROOT / "docs").rglob("*.md")))
EXEMPT = re.compile(r"<!--\s*commands:\s*exempt\s*\((?P<why>[^)]+)\)\s*-->")
HYDRA_MODULES = ("decode.", "features.", "rerank.")
# argparse commands among them (no Hydra config): parsed like the bench scripts
ARGPARSE_MODULES = ("decode.pooled",)


@dataclass(frozen=True)
class Command:
    line: str  # as the README shows it (continuations joined, comment cut)
    exempt: str = ""  # why, when the block is tagged exempt


def _lines(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for raw in joined.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if line:
            out.append(" ".join(line.split()))
    return out


def readme_commands(text: str | None = None) -> list[Command]:
    """The command lines of the README and of the logs it links to (`DOCS`), in order, each once."""
    text = "\n".join(d.read_text() for d in DOCS) if text is None else text
    out: list[Command] = []
    exempt = ""
    for m in re.finditer(r"^```(\w*)\n(.*?)^```|<!--.*?-->|`([^`\n][^`]*)`", text, re.S | re.M):
        if m.group(0).startswith("<!--"):
            tag = EXEMPT.match(m.group(0))
            exempt = tag["why"] if tag else exempt
            continue
        if m.group(2) is not None:  # a fenced block
            if m.group(1) == "bash":
                out += [Command(line, exempt) for line in _lines(m.group(2))]
            exempt = ""
        else:
            span = " ".join(m.group(3).split())
            if re.match(r"^(python -m |make |for .* do python -m )", span):
                out.append(Command(span))
    why: dict[str, str] = {}  # each line once; exempt if any of its blocks is tagged
    for c in out:
        why[c.line] = why.get(c.line, "") or c.exempt
    return [Command(line, exempt) for line, exempt in why.items()]


def _placeholders(line: str, tmp: Path) -> str:
    line = re.sub(r"/path/to/([\w.-]+)", lambda m: str(tmp / "models" / m[1]), line)
    line = line.replace("<run id>", "0123456789abcdef").replace("<partition>", "cpu")
    line = re.sub(r"\s*\[--[^\]]*\]", "", line)  # optional flags shown in brackets
    counter = itertools.count()
    return re.sub(r"<[^<>]*>", lambda _: str(tmp / f"dir{next(counter)}"), line)


def _sweeps(args: list[str]) -> list[list[str]]:
    """Hydra's `-m a=x,y b=z` as one argument list per combination (without `-m`)."""
    choices = []
    for a in args:
        key, sep, value = a.partition("=")
        if sep and "," in value and not value.startswith(("[", "{")):
            choices.append([f"{key}={v}" for v in value.split(",")])
        else:
            choices.append([a])
    return [list(c) for c in itertools.product(*choices)]


def plan(cmd: Command, tmp: Path) -> list[dict]:
    """What to run for one README line: [{'kind': ..., 'argv': [...]}], one per check."""
    line = _placeholders(cmd.line, tmp)
    loop = re.match(r"^for .* do (python -m .*?) & done; wait$", line)
    if loop:
        line = loop[1]
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # environment assignments (OMP_WAIT_POLICY=PASSIVE ...)
    if words[0] == "make":
        target = words[1] if len(words) > 1 else "help"
        if target == "help":
            return [{"kind": "make", "argv": ["make", "help"]}]
        return [{"kind": "make", "argv": ["make", "-n", *words[1:]]}]
    if words[:2] != ["python", "-m"]:
        raise ValueError(f"README command {cmd.line!r}: expected `python -m ...` or `make ...`")
    module, args = words[2], words[3:]
    if module.startswith(HYDRA_MODULES) and module not in ARGPARSE_MODULES:
        multirun = "-m" in args or "--multirun" in args
        args = [a for a in args if a not in ("-m", "--multirun")]
        runs = _sweeps(args) if multirun else [args]
        # a multirun's sweep overrides are composed one value at a time, single-run
        return [{"kind": "hydra", "module": module, "argv": [*a, "--cfg", "job"]} for a in runs]
    return [{"kind": "argparse", "module": module, "argv": args}]


class _Parsed(Exception):
    """Raised once an argparse script has parsed its arguments: nothing more runs."""


def _run_module(module: str, argv: list[str], kind: str) -> dict:
    """`python -m module argv` here; argparse scripts stop right after parsing."""
    from hydra.core.global_hydra import GlobalHydra

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        real(self, *a, **k)
        raise _Parsed

    out, err = io.StringIO(), io.StringIO()
    sys.argv = [module, *argv]
    code = 0
    try:
        if kind == "argparse":
            argparse.ArgumentParser.parse_args = parse_then_stop
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except _Parsed:
        pass
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            err.write(str(e.code))
    except Exception as e:  # reported to the test, which fails naming the command
        code = 1
        err.write(f"{type(e).__name__}: {e}")
    finally:
        argparse.ArgumentParser.parse_args = real
        GlobalHydra.instance().clear()
    return {"code": code, "stdout": out.getvalue()[-2000:], "stderr": err.getvalue()[-2000:]}


def main() -> None:
    sys.path.insert(0, str(ROOT))  # `python -m bench.*` runs from the project root
    checks = json.load(sys.stdin)
    results = [_run_module(c["module"], c["argv"], c["kind"]) for c in checks]
    sys.__stdout__.write("RESULTS " + json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
