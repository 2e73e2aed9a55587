#!/usr/bin/env bash
# The GPU check: one run on a lent CUDA machine (x86-64, Python 3.12, a CUDA torch, an older
# transformers, no network). Run from the repository root of a copy of the working tree with the
# wheels of .whl/ beside it (transformers 5.23.0, gguf, regex; see the report that added this file):
#
#     bash tools/gpu_check.sh            # writes everything to $OUT/gpu.log (OUT defaults to /tmp/gpu_check)
#
# Phases, each under its own `timeout`; a failing phase is reported with its exit code and the next
# one runs:
#   1. the machine: nvidia-smi, torch / CUDA / transformers versions                (~5 s, <= 30)
#   2. the wheels into /tmp/site (no index, no deps), PYTHONPATH=src:/tmp/site      (~10 s, <= 60)
#   3. every `gpu` test: test_gpu.py, test_quantization.py, test_compile.py    (~150 s?, <= 240)
#   4. benchmarks/bench_gpu.py (its own budget 170 s, build and compile included)  (~190 s, <= 220)
#   5. with GPU_CHECK_CPU_TESTS=1 only: the CPU logits parity tests with CUDA visible      (<= 90 s)
# The C++ CPU kernels built here do not load on that machine's torch: TORCHGEMMA_ISA=reference makes
# every CPU operator run its pure-PyTorch reference without trying to load or build them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

export TORCHGEMMA_ISA=reference
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export TOKENIZERS_PARALLELISM=false
SITE=/tmp/site
WHEELS=${WHEELS:-.whl}  # a folder of wheels (a local try of this script: ones for its Python)
PY=${PYTHON:-python3}
START=$SECONDS

phase() {
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name (limit ${limit} s) at $(date -u +%H:%M:%S), $((SECONDS - START)) s in"
    local t=$SECONDS
    timeout --kill-after=15 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit code $rc after $((SECONDS - t)) s$([ "$rc" = 124 ] && echo ' (TIMED OUT)')"
    RESULTS+=("$name: exit $rc, $((SECONDS - t)) s")
}
RESULTS=()

machine() {
    nvidia-smi || echo "nvidia-smi failed"
    "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", torch.cuda.get_device_name(0), f"{p.total_memory / 2**30:.0f} GiB", "capability", p.major, p.minor)
try:
    import transformers
    print("transformers (before the wheels):", transformers.__version__)
except Exception as error:
    print("transformers:", error)
EOF
}

install_wheels() {
    rm -rf "$SITE"
    ls -la "$WHEELS" || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl || return 1
    PYTHONPATH="$PWD/src:$SITE" "$PY" -c "
import transformers, gguf, torchgemma, torchgemma.kernels as k
print('transformers', transformers.__version__, transformers.__file__)
print('torchgemma from', torchgemma.__file__, '|', k.kernel_status())
assert transformers.__version__ == '5.23.0', transformers.__version__
"
}

export -f machine install_wheels
export PY SITE WHEELS
phase "machine" 30 bash -c machine
phase "wheels" 60 bash -c install_wheels
export PYTHONPATH="$PWD/src:$SITE"

# No -x: one run on the machine, every result wanted. addopts is emptied (it asks for two xdist
# workers and deselects gpu tests); -s prints each comparison's measured max |Δ| ("[gpu] ..." lines).
TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && TIMEOUT=(--timeout 200)  # a hung test fails alone
phase "gpu tests" 240 "$PY" -m pytest -o addopts='' -m gpu -p no:cacheprovider -q -s -rfEs \
    ${TIMEOUT[@]+"${TIMEOUT[@]}"} tests/test_gpu.py tests/test_quantization.py tests/test_compile.py

phase "benchmark" 220 "$PY" benchmarks/bench_gpu.py --budget-s 170

if [ "${GPU_CHECK_CPU_TESTS:-0}" = 1 ]; then
    phase "cpu parity tests (CUDA visible)" 90 "$PY" -m pytest -o addopts='' -m 'not slow and not gpu' \
        -p no:cacheprovider -q tests/test_parity.py
fi

echo
echo "=== summary ($((SECONDS - START)) s in all)"
printf '  %s\n' "${RESULTS[@]}"
sleep 2  # let tee write the last lines
