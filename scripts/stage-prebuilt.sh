#!/usr/bin/env bash
# Stage binaries built on a machine without a GPU for scripts/gpu-run-binaries.sh on one with a
# GPU: copy the chosen GPU tests, benchmarks and examples from a build folder into DEST (default
# .prebuilt, git-ignored), strip them, and say how many MiB they take (the device tool carries at
# most 64 MiB with the working tree).
#   scripts/stage-prebuilt.sh [BUILD] [DEST]
# Optional globs, as in gpu-run-binaries.sh (the part after tigon_gpu_tests_ / tigon_bench_ /
# example_): TESTS, BENCHES, EXAMPLES; default every one. The tuning sweeps (bench/tuning/
# tigon_tuning_*, built with -DTIGON_BUILD_TUNING=ON) only with TUNING=1 (every one) or TUNING=GLOB
# (the part after tigon_tuning_). PACK=xz packs the stripped binaries into
# DEST/bins.tar.xz instead (every test, benchmark and example is about 11 MB so; loose, 65 MB), for
# scripts/gpu-full-check.sh. Example:
#   TESTS='@(rope|rms_norm)' BENCHES='@(rope|rms_norm)' EXAMPLES=none scripts/stage-prebuilt.sh
set -euo pipefail
shopt -s extglob nullglob
build=${1:-build}
dest=${2:-.prebuilt}
rm -rf "$dest"
mkdir -p "$dest"
n=0
case "${TUNING:-}" in
  ""|0|none) tuning=() ;;
  1) tuning=("$build"/bench/tuning/tigon_tuning_*) ;;
  *) tuning=("$build"/bench/tuning/tigon_tuning_$TUNING) ;;
esac
for f in "$build"/test/tigon_gpu_tests_${TESTS:-*} "$build"/bench/tigon_bench_${BENCHES:-*} \
         "$build"/examples/example_${EXAMPLES:-*} "${tuning[@]}"; do
  [ -f "$f" ] && [ -x "$f" ] || continue
  cp "$f" "$dest/"
  n=$((n + 1))
done
[ "$n" -gt 0 ] || { echo "no binaries matched under $build" >&2; exit 1; }
strip "$dest"/* 2>/dev/null || true
if [ "${PACK:-}" = xz ]; then
  tmp=$(mktemp -d)
  mv "$dest"/* "$tmp"/
  tar -C "$tmp" -cf - . | xz -T0 -6 > "$dest/bins.tar.xz"
  rm -rf "$tmp"
fi
mib=$(( $(du -sk "$dest" | cut -f1) / 1024 ))
echo "staged $n binaries in $dest: $mib MiB"
if [ "$mib" -gt 56 ]; then
  echo "warning: over 56 MiB; with the working tree and .gpu-deps the device tool's 64 MiB may not hold" >&2
fi
