#!/usr/bin/env bash
# The whole check of prebuilt binaries in one call on a GPU machine, in the order that keeps the
# timings clean: the benchmarks (and examples) alone on the GPU, then every GPU test suite side by
# side (large shapes included), then compute-sanitizer memcheck, racecheck, initcheck and synccheck
# on every case of the small selection (scripts/sanitize-cases.sh) side by side. Writes OUTDIR/summary.txt as it goes (so
# a run cut by its time limit still leaves what it did), the logs under OUTDIR/x, and OUTDIR/x.tgz of
# them at the end.
#   scripts/gpu-full-check.sh BINS OUTDIR
# BINS: a folder of binaries, or a bins.tar.xz from PACK=xz scripts/stage-prebuilt.sh.
# Per-step limits in seconds (environment): BENCH_S (default 230), TEST_S (110), SANITIZE_S (260);
# SANITIZE_JOBS sanitizer runs at a time (default 10). On a machine with two or more GPUs the
# sanitizer step runs on GPU 1 from the start, beside the benchmarks and tests on GPU 0 (whose
# timings it does not share a GPU with); on one GPU it follows them. TUNING=1 (or a glob, as in
# gpu-run-binaries.sh) also runs the staged tuning sweeps, alone on the GPU after the benchmarks,
# within TUNING_S seconds (default 600).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# The shared libraries staged by shared/tools/gpu-deps.sh (Debian's Google Benchmark, which the
# binaries built here link), when present.
deps=$here/../.gpu-deps/lib/x86_64-linux-gnu
[ -d "$deps" ] && export LD_LIBRARY_PATH=$deps${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
src=${1:?usage: scripts/gpu-full-check.sh BINS OUTDIR}
out=${2:?usage: scripts/gpu-full-check.sh BINS OUTDIR}
mkdir -p "$out/x/bench" "$out/x/tests" "$out/x/san"
S=$out/summary.txt
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)" >> "$S"; }
bins=$src
if [ -f "$src" ]; then
  bins=$(mktemp -d)
  tar -xJf "$src" -C "$bins"
fi
tests=$(mktemp -d)
ln -sf "$bins"/tigon_gpu_tests_* "$tests"/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >> "$S" 2>&1
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
sanitize_step() {
  DEADLINE=$(( $(date +%s) + ${SANITIZE_S:-260} - 10 )) TESTS=none BENCHES=none TUNING= SANITIZE_JOBS=${SANITIZE_JOBS:-10} \
    timeout $(( ${SANITIZE_S:-260} + 10 )) \
    "$here/gpu-run-binaries.sh" "$tests" "$out/x/san" "${SANITIZE_S:-260}" > /dev/null 2>&1
  pkill -f "^compute-sanitizer " 2>/dev/null  # runs a cut left behind (not this script's own command line)
}
if [ "$gpus" -ge 2 ]; then
  step "compute-sanitizer on GPU 1, beside the rest on GPU 0"
  (export CUDA_VISIBLE_DEVICES=1; sanitize_step) &
  san_pid=$!
  export CUDA_VISIBLE_DEVICES=0
fi
step "benchmarks and examples"
TESTS=none SANITIZE=none TUNING= timeout "${BENCH_S:-230}" "$here/gpu-run-binaries.sh" "$bins" "$out/x/bench" 120 > /dev/null 2>&1
grep -v "^tigon_gpu_tests_none" "$out/x/bench/summary.txt" >> "$S"
case "${TUNING:-}" in
  ""|0|none) ;;
  *)
    step "tuning sweeps"
    mkdir -p "$out/x/tuning"
    TESTS=none EXAMPLES=none BENCHES=none SANITIZE=none timeout "${TUNING_S:-600}" \
      "$here/gpu-run-binaries.sh" "$bins" "$out/x/tuning" "${TUNING_S:-600}" > /dev/null 2>&1
    grep -v "^tigon_gpu_tests_none\|^tigon_bench_none" "$out/x/tuning/summary.txt" >> "$S"
    ;;
esac
step "GPU tests, every suite, large shapes included"
for t in "$tests"/tigon_gpu_tests_*; do
  n=$(basename "$t")
  (timeout "${TEST_S:-110}" "$t" > "$out/x/tests/$n.log" 2>&1
   echo "$n: rc=$? :: $(grep -E 'All tests passed|test cases:|assertions:' "$out/x/tests/$n.log" | tr '\n' ' ')" \
     > "$out/x/tests/.$n") &
done
wait $(jobs -p | grep -vx "${san_pid:-none}")
cat "$out"/x/tests/.tigon_gpu_tests_* >> "$S" 2>/dev/null
if [ "$gpus" -ge 2 ]; then
  wait "$san_pid"
  step "compute-sanitizer (GPU 1) done"
else
  step "compute-sanitizer"
  sanitize_step
fi
# A step cut before its summary still left each finished run's line.
grep -q compute-sanitizer "$out/x/san/summary.txt" 2>/dev/null || cat "$out"/x/san/sanitizer/results.txt >> "$S" 2>/dev/null
grep compute-sanitizer "$out/x/san/summary.txt" >> "$S" 2>/dev/null
step "end"
(cd "$out" && tar czf x.tgz x)
cat "$S"
