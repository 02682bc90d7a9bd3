#!/usr/bin/env bash
# Run already-built GPU test, example and benchmark binaries on a GPU machine (when the build happened
# elsewhere; scripts/stage-prebuilt.sh copies and strips them): the GPU tests, the examples, the
# benchmarks, then compute-sanitizer memcheck and racecheck on the tests (without [large] and without
# the hidden cases: two ranks, cold capture). Logs to OUTDIR; a summary is printed last.
#   scripts/gpu-run-binaries.sh BINDIR OUTDIR [seconds per step, default 120]
# Optional globs narrow each step: TESTS (default *), EXAMPLES (default *), BENCHES (default *),
# SANITIZE (default *, none: no sanitizer runs), matched against the part of the name after
# tigon_gpu_tests_ / example_ / tigon_bench_; SANITIZE_JOBS sanitizer runs at a time (default 1).
# The tuning sweeps (tigon_tuning_*, from -DTIGON_BUILD_TUNING=ON) run only when asked for, after
# the benchmarks: TUNING=1 every one, or TUNING=GLOB those matching the part after tigon_tuning_.
set -uo pipefail
shopt -s extglob nullglob
bin=${1:?usage: scripts/gpu-run-binaries.sh BINDIR OUTDIR [seconds]}
out=${2:?usage: scripts/gpu-run-binaries.sh BINDIR OUTDIR [seconds]}
limit=${3:-120}
mkdir -p "$out"
summary() { echo "$*" | tee -a "$out/summary.txt"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/nvidia-smi.txt" 2>&1
t0=$(date +%s)
for t in "$bin"/tigon_gpu_tests_${TESTS:-*}; do
  n=$(basename "$t")
  timeout "$limit" "$t" > "$out/$n.log" 2>&1
  summary "$n: rc=$? :: $(grep -E 'All tests passed|test cases:|assertions:' "$out/$n.log" | tr '\n' ' ')"
done
for e in "$bin"/example_${EXAMPLES:-*}; do
  [ -x "$e" ] || continue
  n=$(basename "$e")
  timeout "$limit" "$e" > "$out/$n.log" 2>&1
  summary "$n: rc=$? :: $(tail -n 3 "$out/$n.log" | tr '\n' ' ')"
done
for b in "$bin"/tigon_bench_${BENCHES:-*}; do
  n=$(basename "$b")
  timeout "$limit" "$b" --benchmark_out="$out/$n.json" --benchmark_out_format=json > "$out/$n.log" 2>&1
  summary "$n: rc=$?"
  grep -E "^ceiling|^host cost" "$out/$n.log" | tee -a "$out/summary.txt"
  sed -n '/^benchmark (median/,$p' "$out/$n.log" | tee -a "$out/summary.txt"
done
case "${TUNING:-}" in
  ""|0|none) tuning=() ;;
  1) tuning=("$bin"/tigon_tuning_*) ;;
  *) tuning=("$bin"/tigon_tuning_$TUNING) ;;
esac
for b in "${tuning[@]}"; do
  n=$(basename "$b")
  timeout "$limit" "$b" --benchmark_out="$out/$n.json" --benchmark_out_format=json > "$out/$n.log" 2>&1
  summary "$n: rc=$?"
  grep -E "^ceiling" "$out/$n.log" | tee -a "$out/summary.txt"
  sed -n '/^benchmark (median/,$p' "$out/$n.log" | tee -a "$out/summary.txt"
done
# One sanitizer run; prints its summary line.
sanitize() {
  local tool=$1 t=$2 n rc extra=()
  n=$(basename "$t")
  timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 "$t" "~[large]~[.]" > "$out/$tool-$n.log" 2>&1
  rc=$?
  # racecheck reports hazards inside cuBLAS's own GEMM kernels (nvjet: TMA and wgmma synchronised
  # through mbarriers; the vendor library's code, not tigon's); tigon's kernels must have none.
  # (Excluding those kernels from racecheck with --kernel-name-exclude made them fault on the
  # H200.) Every report names its kernel on an "at" line.
  [ "$tool" = racecheck ] && extra=("reports outside cuBLAS kernels: $(grep -E '^=+ +at ' "$out/$tool-$n.log" | grep -vc nvjet) ::")
  echo "compute-sanitizer $tool $n: rc=$rc :: ${extra[*]} $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|All tests passed|test cases:' "$out/$tool-$n.log" | tr '\n' ' ')"
}
# SANITIZE_JOBS runs (default 1) at a time: they share the GPU, so the step takes less wall time.
# The longest runs start first (racecheck on the cross-entropy and launch suites took over 200 s
# sharing the GPU), so that a step limit cuts the short ones last.
jobs_max=${SANITIZE_JOBS:-1}
runs=()
for t in "$bin"/tigon_gpu_tests_${SANITIZE:-*}; do
  [ -e "$t" ] || continue
  case "$(basename "$t")" in
    *_cross_entropy|*_launch) runs=("racecheck $t" "${runs[@]}") ;;
    *) runs+=("racecheck $t") ;;
  esac
done
for t in "$bin"/tigon_gpu_tests_${SANITIZE:-*}; do
  [ -e "$t" ] && runs+=("memcheck $t")
done
for r in "${runs[@]}"; do
  tool=${r%% *}
  t=${r#* }
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 1; done
  sanitize "$tool" "$t" > "$out/.sanitize-$tool-$(basename "$t")" &
done
wait
cat "$out"/.sanitize-* 2>/dev/null >> "$out/summary.txt"
cat "$out"/.sanitize-* 2>/dev/null
rm -f "$out"/.sanitize-*
summary "total: $(( $(date +%s) - t0 )) s"
