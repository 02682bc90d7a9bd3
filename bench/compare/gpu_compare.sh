#!/usr/bin/env bash
# Side-by-side and end-to-end comparison on a GPU machine, in one call:
#
#   bench/compare/gpu_compare.sh OUTDIR [PHASES]
#
# PHASES: a comma list run in this order, or one of the shorthands
#   ops         build, ops                      (the default)
#   e2e         build, e2e-train, e2e-ckpt
#   all         build, e2e-train, ops, e2e-ckpt
#   build       tigon_torch installed with pip (examples/torch/gpu_check.sh's build phase; it falls
#               back to the JIT build); skipped when tigon_torch._C already imports, unless
#               TIGON_COMPARE_REBUILD=1. Leave it out when the operator library was built elsewhere
#               and is preloaded (TIGON_PRELOAD and PYTHONPATH as scripts/stage-torch-ext.sh says)
#   ops         bench/compare/ops.py       --out OUTDIR/ops  $OPS_ARGS
#   e2e-train   bench/compare/e2e.py       --out OUTDIR/e2e --phases train  $E2E_ARGS
#   e2e-ckpt    bench/compare/e2e.py       --out OUTDIR/e2e-ckpt --phases ckpt  $E2E_ARGS
#   plot        bench/compare/plot.py on every result folder (also run at the end of any call)
#
# The call keeps within TIGON_COMPARE_BUDGET_S seconds (default 560): each benchmark phase gets
# --max-seconds = its fair share of the time left (the time left / the phases still to run; the
# last gets all of it), and the scripts stop starting rows / steps / attempts when their share is
# spent and list what they skipped. Liger-Kernel is used when importable: its source carried to the
# machine in .liger/ (see bench/compare/README.md) is put on PYTHONPATH (.liger/src), or LIGER_SRC.
# TIGON_TORCH_HIDDEN_SIZES defaults to 2048,4096,8192 here (the sizes benchmarked; a shorter build).
# Writes OUTDIR/env.log, build/ (gpu_check.sh's logs), ops/, e2e/, e2e-ckpt/ (JSON, markdown, PNG,
# logs) and summary.txt.
set -uo pipefail

OUT=${1:?usage: gpu_compare.sh OUTDIR [ops|e2e|all|PHASE,PHASE,...]}
SEL=${2:-ops}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY=${PYTHON:-$(command -v python || command -v python3)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUDGET=${TIGON_COMPARE_BUDGET_S:-560}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export MAX_JOBS=${MAX_JOBS:-16}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TIGON_TORCH_HIDDEN_SIZES=${TIGON_TORCH_HIDDEN_SIZES:-2048,4096,8192}
export TIGON_TORCH_BUILD_DIR=${TIGON_TORCH_BUILD_DIR:-$ROOT/examples/torch/build/jit}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

case "$SEL" in
  ops) PHASES="build,ops" ;;
  e2e) PHASES="build,e2e-train,e2e-ckpt" ;;
  all) PHASES="build,e2e-train,ops,e2e-ckpt" ;;
  *) PHASES="$SEL" ;;
esac
IFS=, read -r -a LIST <<< "$PHASES"

LIGER_SRC=${LIGER_SRC:-$ROOT/.liger/src}
if [ -d "$LIGER_SRC/liger_kernel" ]; then
  export PYTHONPATH="$LIGER_SRC${PYTHONPATH:+:$PYTHONPATH}"
  note "liger: source at $LIGER_SRC"
else
  note "liger: no source at $LIGER_SRC (carry .liger, see bench/compare/README.md); Liger rows will say 'unavailable' unless it is installed"
fi

{
  date -u
  nvidia-smi || true
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  "$PY" -c "import transformers; print('transformers', transformers.__version__)" || true
  "$PY" -c "import triton; print('triton', triton.__version__)" || true
  "$PY" -c "import liger_kernel, os; print('liger_kernel from', os.path.dirname(liger_kernel.__file__))" || true
  "$PY" -c "import matplotlib; print('matplotlib', matplotlib.__version__)" || true
  echo "phases=$PHASES budget=${BUDGET}s MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST TIGON_TORCH_HIDDEN_SIZES=$TIGON_TORCH_HIDDEN_SIZES"
} > "$OUT/env.log" 2>&1

installed() { (cd "$OUT" && "$PY" -c "import tigon_torch._C" > /dev/null 2>&1); }

use_jit_if_needed() {
  if [ -n "${TIGON_PRELOAD:-}" ] && [ -f "$TIGON_PRELOAD" ]; then
    export PYTHONPATH="$ROOT/examples/torch${PYTHONPATH:+:$PYTHONPATH}"
    note "tigon_torch: the library preloaded from $TIGON_PRELOAD (scripts/stage-torch-ext.sh)"
  elif installed; then
    note "tigon_torch: the pip-installed extension"
  elif [ -d "$TIGON_TORCH_BUILD_DIR" ]; then
    export PYTHONPATH="$ROOT/examples/torch${PYTHONPATH:+:$PYTHONPATH}" TIGON_TORCH_JIT=1
    note "tigon_torch: the JIT build in $TIGON_TORCH_BUILD_DIR"
  else
    export PYTHONPATH="$ROOT/examples/torch${PYTHONPATH:+:$PYTHONPATH}"
    note "tigon_torch: not installed and no JIT build; the scripts will JIT-build on first use (minutes)"
  fi
}

build() {
  local start=$(date +%s) rc
  if installed && [ "${TIGON_COMPARE_REBUILD:-0}" = 0 ]; then
    note "build: skipped, tigon_torch._C already imports (TIGON_COMPARE_REBUILD=1 rebuilds)"
    return 0
  fi
  TIGON_CHECK_BUDGET_S=$(left) "$ROOT/examples/torch/gpu_check.sh" "$OUT/build" pip build > "$OUT/build.log" 2>&1
  rc=$?
  note "build: rc $rc, $(( $(date +%s) - start )) s ($(tr '\n' ' ' < "$OUT/build/summary.txt" 2>/dev/null))"
  return $rc
}

# phase index -> its --max-seconds: a fair share of what is left, keeping 15 s for the plots.
share() {  # index of this phase in LIST
  local i=$1 n=0 j l
  for (( j=i; j<${#LIST[@]}; j++ )); do
    case "${LIST[$j]}" in ops|e2e-train|e2e-ckpt) n=$((n + 1)) ;; esac
  done
  l=$(( $(left) - 15 ))
  [ $n -gt 0 ] || n=1
  echo $(( l / n ))
}

bench() {  # name, seconds, command...
  local name=$1 secs=$2 start=$(date +%s) rc
  shift 2
  if [ "$secs" -lt 30 ]; then
    note "$name: skipped, ${secs} s left of the ${BUDGET} s budget"
    return 1
  fi
  (cd "$ROOT" && timeout -k 10 $(( secs + 40 )) "$@" --max-seconds "$secs") 2>&1 | tee "$OUT/$name.log" | grep -E "^\[(driver|[a-z]+ (train|ckpt))\]|wrote|skipped|ERROR" | tail -n 400
  rc=${PIPESTATUS[0]}
  note "$name: rc $rc, $(( $(date +%s) - start )) s of ${secs} s"
  return $rc
}

built=1
for i in "${!LIST[@]}"; do
  phase=${LIST[$i]}
  case "$phase" in
    build) build || { status=1; built=0; } ;;
    ops|e2e-train|e2e-ckpt)
      if [ -z "${where_done:-}" ]; then use_jit_if_needed; where_done=1; fi
      if [ $built -eq 0 ]; then note "$phase: tigon_torch did not build; running without it (tigon rows 'unavailable')"; fi
      secs=$(share "$i")
      case "$phase" in
        ops)       bench ops "$secs" "$PY" "$HERE/ops.py" --out "$OUT/ops" ${OPS_ARGS:-} || status=1 ;;
        e2e-train) bench e2e-train "$secs" "$PY" "$HERE/e2e.py" --out "$OUT/e2e" --phases train ${E2E_ARGS:-} || status=1 ;;
        e2e-ckpt)  bench e2e-ckpt "$secs" "$PY" "$HERE/e2e.py" --out "$OUT/e2e-ckpt" --phases ckpt ${E2E_ARGS:-} || status=1 ;;
      esac ;;
    plot) ;;
    *) note "unknown phase '$phase' (build, ops, e2e-train, e2e-ckpt, plot)"; status=1 ;;
  esac
done

for d in ops e2e e2e-ckpt; do
  if [ -d "$OUT/$d" ]; then "$PY" "$HERE/plot.py" "$OUT/$d" >> "$OUT/plot.log" 2>&1 || true; fi
done
for f in ops/ops.md e2e/e2e.md e2e-ckpt/e2e.md; do
  if [ -f "$OUT/$f" ]; then echo; cat "$OUT/$f"; fi
done
note "gpu_compare: $([ $status -eq 0 ] && echo OK || echo 'FAILED (see summary.txt and the logs)'), $(( $(date +%s) - START )) s"
exit $status
