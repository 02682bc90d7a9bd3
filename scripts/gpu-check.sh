#!/usr/bin/env bash
# The full check on a GPU machine, in one go: configure and build (Release, sm_90), every test
# (host + GPU + packaging), compute-sanitizer memcheck, racecheck, initcheck and synccheck on every
# case of the GPU tests' small selection (without the [large] cases and the hidden ones, which need
# two GPUs or a process of their own; one process per case, each capped at 240 s, scripts/
# sanitize-cases.sh; SANITIZE_JOBS at a time, default 4),
# and the benchmarks with their JSON. Logs go to OUTDIR; a summary is printed last.
#   scripts/gpu-check.sh OUTDIR [extra CMake configure arguments, e.g. -DCatch2_DIR=...]
# TUNING=1 also builds the tuning sweeps (-DTIGON_BUILD_TUNING=ON) and runs them after the
# benchmarks (TUNING=GLOB: those whose name after tigon_tuning_ matches).
set -uo pipefail
out=${1:?usage: scripts/gpu-check.sh OUTDIR [cmake args]}
shift
mkdir -p "$out"
jobs=$(nproc)
summary() { echo "$*" | tee -a "$out/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  > "$out/nvidia-smi.txt" 2>&1
case "${TUNING:-}" in
  ""|0|none) tuning=OFF ;;
  *) tuning=ON ;;
esac
t0=$(date +%s)
if ! cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
     -DTIGON_BUILD_TUNING=$tuning "$@" \
     > "$out/configure.log" 2>&1; then
  tail -40 "$out/configure.log"; exit 1
fi
if ! cmake --build build-gpu -j "$jobs" > "$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -60; exit 1
fi
summary "build: $(( $(date +%s) - t0 )) s"

ctest --test-dir build-gpu -LE 'bench|tuning' -j 4 --output-on-failure > "$out/tests.log" 2>&1
summary "ctest (host + gpu + packaging): rc=$? :: $(grep -E 'tests passed|tests failed' "$out/tests.log")"
grep -E "^\s*[0-9]+/[0-9]+ Test" "$out/tests.log" | sed 's/^ *//' | tee -a "$out/summary.txt"
grep -E "All tests passed|test cases:|assertions" "$out/tests.log" | tail -5 | tee -a "$out/summary.txt"

# Every sanitizer on every test case of the small selection, one process per case (scripts/
# sanitize-cases.sh), JOBS at a time; one summary line per tool and suite.
JOBS=${SANITIZE_JOBS:-4} "$(dirname "$0")/sanitize-cases.sh" "$out/sanitizer" memcheck,racecheck,initcheck,synccheck \
  build-gpu/test/tigon_gpu_tests_* | grep "^compute-sanitizer" | tee -a "$out/summary.txt"

for b in build-gpu/bench/tigon_bench_*; do
  name=$(basename "$b")
  timeout 300 "$b" --benchmark_out="$out/$name.json" --benchmark_out_format=json > "$out/$name.log" 2>&1
  summary "$name: rc=$?"
  sed -n '/^benchmark (median/,$p' "$out/$name.log" | tee -a "$out/summary.txt"
  grep -E "^ceiling" "$out/$name.log" | tee -a "$out/summary.txt"
done
if [ "$tuning" = ON ]; then
  glob=$TUNING
  [ "$glob" = 1 ] && glob='*'
  for b in build-gpu/bench/tuning/tigon_tuning_$glob; do
    [ -x "$b" ] || continue
    name=$(basename "$b")
    timeout 600 "$b" --benchmark_out="$out/$name.json" --benchmark_out_format=json > "$out/$name.log" 2>&1
    summary "$name: rc=$?"
    sed -n '/^benchmark (median/,$p' "$out/$name.log" | tee -a "$out/summary.txt"
    grep -E "^ceiling" "$out/$name.log" | tee -a "$out/summary.txt"
  done
fi
summary "total: $(( $(date +%s) - t0 )) s"
