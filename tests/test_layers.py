"""The layer contracts of pyproject.toml hold, and a broken one names its import chain."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from specrank.settings.paths import PROJECT_ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_layer_contract_is_kept():
    res = _lint()
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


def test_a_broken_contract_names_the_import_chain(tmp_path):
    # decode.run does import rerank (it is an entry point); forbid it to see the report.
    config = tmp_path / "contracts.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["decode", "rerank", "features", "pairs", "tree", "selection", '
        '"specrank", "calibrate", "recipes"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "probe"\n'
        'type = "forbidden"\n'
        'source_modules = ["decode.run"]\n'
        'forbidden_modules = ["rerank.serving"]\n'
    )
    res = _lint("--config", str(config))
    assert res.returncode == 1
    assert "probe BROKEN" in res.stdout
    assert "decode.run -> rerank.serving" in res.stdout


# every top-level package of the project (pyproject's [tool.setuptools.packages.find])
PACKAGES = ["specrank", "calibrate", "selection", "tree", "pairs", "features", "rerank", "recipes",
            "decode"]  # fmt: skip
MAX_MODULE_LINES = 400  # small modules by pipeline stage (the developers' guide)


def test_every_module_is_small():
    folders = [*PACKAGES, "bench", "tests"]
    sizes = {
        str(path.relative_to(PROJECT_ROOT)): len(path.read_text().splitlines())
        for folder in folders
        for path in (PROJECT_ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 100  # the walk found the project's modules
    large = {name: n for name, n in sizes.items() if n >= MAX_MODULE_LINES}
    assert not large, f"modules of {MAX_MODULE_LINES}+ lines (split them by stage): {large}"


def test_no_module_imports_itself_back():
    """No circle of imports between modules (annotation-only imports counted too): the
    layer contracts order folders; this holds inside them as well."""
    import grimp  # import-linter's own import graph

    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    circles = sorted(
        {
            tuple(sorted((module, imported)))
            for module in graph.modules
            for imported in graph.find_modules_directly_imported_by(module)
            if graph.find_shortest_chain(importer=imported, imported=module)
        }
    )
    assert not circles, f"modules that import each other (directly or through others): {circles}"


MAX_FUNCTION_LINES = 60  # lines of code: docstrings, comments and blank lines not counted


def _code_lines(lines: list[str], node) -> int:
    body = node.body
    doc = None
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        doc = (body[0].lineno, body[0].end_lineno) if isinstance(body[0].value.value, str) else None
    return sum(
        1
        for i in range(node.lineno, node.end_lineno + 1)
        if not (doc and doc[0] <= i <= doc[1])
        and lines[i - 1].strip()
        and not lines[i - 1].strip().startswith("#")
    )


def test_no_function_is_over_60_lines():
    long = {}
    for folder in PACKAGES:
        for path in (PROJECT_ROOT / folder).rglob("*.py"):
            text = path.read_text()
            lines = text.splitlines()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = _code_lines(lines, node)
                    if n > MAX_FUNCTION_LINES:
                        long[f"{path.relative_to(PROJECT_ROOT)}:{node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (split them): {long}"


def test_entry_points_import_no_library_they_only_need_late():
    """`python -m <stage> --cfg job` imports the stage's module first; MLflow (about 1.5 s)
    and skops (about 3 s) are imported where they are used, not by importing an entry point."""
    code = ("import sys, decode.record, decode.run, rerank.train, rerank.transfer; "
            "print(sorted(m for m in ('mlflow', 'skops') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PROJECT_ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_offline_commands_do_not_import_transformers():
    """Training and feature extraction read stores, never a model: transformers (about 1.9 CPU
    s of imports with what it pulls in) is imported only where a model or cache is built."""
    code = (
        "import sys, features.extract, rerank.train; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout[:300]
