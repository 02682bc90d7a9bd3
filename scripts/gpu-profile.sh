#!/usr/bin/env bash
# Nsight Compute on the kernels furthest from their targets, through the benchmark binaries (one
# launch each, after warm-up; the card's clocks are left alone: --clock-control none). Text reports
# (speed of light, compute workload and pipes, memory workload, occupancy, warp stall reasons,
# scheduler, instruction counts) go to OUTDIR.
#   scripts/gpu-profile.sh BINDIR OUTDIR
# BINDIR holds the tigon_bench_* binaries (a build's bench/ folder, or prebuilt copies).
set -uo pipefail
bin=${1:?usage: scripts/gpu-profile.sh BINDIR OUTDIR}
out=${2:?usage: scripts/gpu-profile.sh BINDIR OUTDIR}
mkdir -p "$out"
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
          --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats
          --section InstructionStats --print-details all)  # all: the stall reasons behind WarpStateStats too
# name | benchmark binary | --benchmark_filter | kernel name regex
targets=(
  "ce_grad|cross_entropy|^BM_grad/8192/128256/|ce_resident_kernel"
  "ce_softcap|cross_entropy|^BM_softcap/8192/128256/|ce_resident_opt_kernel"
  "ce_argmax|cross_entropy|^BM_argmax/8192/128256/|ce_resident_opt_kernel"
  "ce_shard_stats|cross_entropy|^BM_shard_stats/8192/128256/|ce_resident_opt_kernel"
  "rms_bwd|rms_norm|^BM_backward/16384/4096|rms_norm_bwd_kernel"
  "rms_bwd_colsum|rms_norm|^BM_backward/16384/4096|column_sum_kernel"
  "ln_bwd|layer_norm|^BM_backward/16384/4096|layer_norm_bwd_kernel"
  "rope_fwd|rope|^BM_fwd/4/4096|rope_heads_kernel"
  "rope_fwd_bhtd|rope|^BM_fwd_bhtd/4/4096|rope_heads_kernel"
)
for t in "${targets[@]}"; do
  IFS='|' read -r name b filter kernel <<< "$t"
  exe="$bin/tigon_bench_$b"
  [ -x "$exe" ] || { echo "$name: $exe missing" | tee -a "$out/summary.txt"; continue; }
  timeout 240 ncu --clock-control none --kernel-name "regex:$kernel" --launch-skip 20 --launch-count 1 \
    "${sections[@]}" "$exe" --benchmark_filter="$filter" > "$out/ncu-$name.txt" 2>&1
  rc=$?
  echo "$name: rc=$rc" | tee -a "$out/summary.txt"
  grep -E "DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per Thread|Duration|Stall" \
    "$out/ncu-$name.txt" | head -n 20 | tee -a "$out/summary.txt"
done
