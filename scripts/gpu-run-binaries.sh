#!/usr/bin/env bash
# Run already-built GPU test, example and benchmark binaries on a GPU machine (when the build happened
# elsewhere; scripts/stage-prebuilt.sh copies and strips them): the GPU tests, the examples, the
# benchmarks, then compute-sanitizer memcheck, racecheck, initcheck and synccheck on every case of
# the tests' small selection (scripts/sanitize-cases.sh). Logs to OUTDIR; a summary is printed last.
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
# The four sanitizers on every case of the small selection, one process per case (sanitize-cases.sh),
# SANITIZE_JOBS at a time (default 1; they share the GPU), each capped at the step limit; none starts
# after DEADLINE (epoch seconds) when it is set.
san=()
for t in "$bin"/tigon_gpu_tests_${SANITIZE:-*}; do
  [ -e "$t" ] && san+=("$t")
done
if [ "${#san[@]}" -gt 0 ]; then
  JOBS=${SANITIZE_JOBS:-1} CAP=$limit "$(dirname "$0")/sanitize-cases.sh" "$out/sanitizer" memcheck,racecheck,initcheck,synccheck "${san[@]}" \
    > "$out/sanitizer.txt" 2>&1
  grep "^compute-sanitizer" "$out/sanitizer.txt" | tee -a "$out/summary.txt"
fi
summary "total: $(( $(date +%s) - t0 )) s"
