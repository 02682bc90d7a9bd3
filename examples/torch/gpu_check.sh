#!/usr/bin/env bash
# The PyTorch extension's whole check on a GPU machine, in one call:
#
#   examples/torch/gpu_check.sh OUTDIR [pip|jit] [all|build|fast|convergence]
#
#   pip  (default)  pip install --no-build-isolation --no-deps examples/torch, compiled operators
#                   required (TIGON_TORCH_BUILD_EXT=1; falls back to the JIT
#                   build, and says so, if the pip build fails)
#   jit             torch.utils.cpp_extension.load into examples/torch/build/jit
#   all  (default)  build, then the fast tests (every op, the patches), then the convergence tests
#
# Writes into OUTDIR: env.log (versions, GPU), build.log, pytest-fast.log / junit-fast.xml,
# pytest-convergence.log / junit-convergence.xml, summary.txt. MAX_JOBS defaults to 16 and
# TORCH_CUDA_ARCH_LIST to 9.0. The whole call keeps within TIGON_CHECK_BUDGET_S seconds (default
# 570): a test phase still running then is interrupted (pytest still writes its summary), and a
# phase with no time left is skipped, both said in summary.txt. Exit status: 0 when every phase
# run passed.
set -uo pipefail

OUT=${1:?usage: gpu_check.sh OUTDIR [pip|jit] [all|build|fast|convergence]}
MODE=${2:-pip}
PHASE=${3:-all}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-$(command -v python || command -v python3)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TIGON_TORCH_BUILD_DIR=${TIGON_TORCH_BUILD_DIR:-$HERE/build/jit}
export PYTHONUNBUFFERED=1
BUDGET=${TIGON_CHECK_BUDGET_S:-570}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }

{
  date -u
  nvidia-smi || true
  nvcc --version || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" || true
  "$PY" -c "import triton; print('triton', triton.__version__)" || true
  echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST mode=$MODE phase=$PHASE"
} > "$OUT/env.log" 2>&1

build() {
  local start=$(date +%s) rc
  if [ "$MODE" = pip ]; then
    TIGON_TORCH_BUILD_EXT=1 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v "$HERE" > "$OUT/build.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
      note "build: pip install failed (rc $rc, see build.log); trying the JIT build"
      "$PY" -m pip uninstall -y tigon_torch >> "$OUT/build.log" 2>&1 || true
      MODE=jit
    fi
  fi
  if [ "$MODE" = jit ]; then
    export TIGON_TORCH_JIT=1
    (cd "$OUT" && PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
      "import tigon_torch._ext as e; print('built in', e.jit_build(verbose=True))") >> "$OUT/build.log" 2>&1
    rc=$?
  fi
  note "build ($MODE): rc $rc, $(( $(date +%s) - start )) s"
  return $rc
}

run_tests() {  # name, pytest selection arguments...
  local name=$1 start=$(date +%s) rc left
  shift
  left=$(( BUDGET - (start - START) ))
  if [ $left -lt 20 ]; then
    note "tests $name: skipped, no time left in the ${BUDGET} s budget"
    return 1
  fi
  (cd "$OUT" && PYTHONPATH="$([ "$MODE" = jit ] && echo "$HERE")" timeout -s INT -k 15 "$left" "$PY" -m pytest \
     "$HERE/tests" -v -s -rfEs --durations=25 -p no:cacheprovider --junitxml="$OUT/junit-$name.xml" "$@") \
     > "$OUT/pytest-$name.log" 2>&1
  rc=$?
  if { [ $rc -eq 124 ] || [ $rc -eq 2 ]; } && grep -q "KeyboardInterrupt" "$OUT/pytest-$name.log"; then
    note "tests $name: interrupted at the ${BUDGET} s budget (see pytest-$name.log)"
  fi
  note "tests $name: rc $rc, $(( $(date +%s) - start )) s: $(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$OUT/pytest-$name.log" | tail -1)"
  return $rc
}

built=1
case "$PHASE" in
  all|build) build || { status=1; built=0; } ;;
  *) if [ "$MODE" = jit ]; then export TIGON_TORCH_JIT=1; fi ;;
esac
# The convergence tests run even when a fast test failed: one call gives every result.
if [ $built -eq 1 ] && { [ "$PHASE" = all ] || [ "$PHASE" = fast ]; }; then
  run_tests fast -m "not slow" || status=1
fi
if [ $built -eq 1 ] && { [ "$PHASE" = all ] || [ "$PHASE" = convergence ]; }; then
  run_tests convergence -m slow || status=1
fi
note "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
