#!/usr/bin/env bash
# compute-sanitizer over GPU test binaries, one process per test case, so that no run has to finish
# a whole suite under a tool (racecheck over the cross-entropy suite's cases together outlasts any
# sensible cap). The small selection only: without the [large] cases and the hidden ones (two ranks,
# cold capture), which need two GPUs or a process of their own. racecheck's reports inside cuBLAS's
# own GEMM kernels (nvjet: TMA and wgmma synchronised through mbarriers, the vendor library's code)
# are counted apart, and so are memcheck's reports of the API errors NCCL's communicator set-up
# handles itself; tigon's kernels must have none. initcheck does not see the writes of cuBLAS's GEMM
# kernels, so the tests poison every buffer a GEMM writes and the scratch cuBLASLt is handed (every
# byte initialised, NaN where the GEMM does not write). The processes run with
# TIGON_TEST_SANITIZER=<tool>: the suites' slowest cases then run their sanitizer-sized shapes
# (gpu_test::sanitizer_sized(): fewer and smaller shapes that still reach every kernel, dtype and
# option), so that each case finishes in minutes under any tool; under synccheck, launches with
# clusters over 8 blocks are left out (gpu_test::synccheck_skips_cluster: the tool stops 16-block
# launches, scripts/probes/cluster_synccheck.cu).
#   scripts/sanitize-cases.sh OUTDIR TOOLS BINARY...     TOOLS: comma list, e.g. memcheck,racecheck
# Environment: JOBS runs at a time (default 4; they share the GPU), CAP seconds per run (default 240),
# DEADLINE (epoch seconds) after which no run starts, DONE a results.txt of an earlier run whose
# finished runs (clean, errors or stopped) are not run again.
# Writes OUTDIR/<tool>-<suite>-<case>.log; prints one line per run, then one per tool and suite:
# its cases, the clean ones, those with errors and those stopped at the cap.
set -uo pipefail
out=${1:?usage: scripts/sanitize-cases.sh OUTDIR TOOLS BINARY...}
tools=${2:?usage: scripts/sanitize-cases.sh OUTDIR TOOLS BINARY...}
shift 2
mkdir -p "$out"
jobs_max=${JOBS:-4}
cap_max=${CAP:-240}
deadline=${DEADLINE:-0}
list=$out/cases.txt
: > "$list"
for tool in ${tools//,/ }; do
  for t in "$@"; do
    [ -x "$t" ] || continue
    "$t" --list-test-names-only "~[large]~[.]" 2>/dev/null | grep -v -E '^$|^GPU:|^SKIPPED|^ ' |
      while IFS= read -r name; do printf '%s\t%s\t%s\n' "$tool" "$t" "$name"; done >> "$list"
  done
done
one() {  # tool binary case
  local tool=$1 t=$2 name=$3 suite s0 cap rc f state extra=""
  suite=$(basename "$t"); suite=${suite#tigon_gpu_tests_}
  s0=$(date +%s)
  cap=$cap_max
  [ "$deadline" -gt 0 ] && [ $(( deadline - s0 )) -lt "$cap" ] && cap=$(( deadline - s0 ))
  f=$out/$tool-$suite-$(printf '%s' "$name" | tr -c 'A-Za-z0-9' '_' | cut -c1-60).log
  # Catch2 reads a comma in a test spec as "or": escaped.
  TIGON_TEST_SANITIZER=$tool timeout "$cap" compute-sanitizer --tool "$tool" --error-exitcode 9 "$t" \
    "$(printf '%s' "$name" | sed 's/,/\\,/g')" > "$f" 2>&1
  rc=$?
  state=clean
  [ "$rc" = 124 ] && state=stopped
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && state=errors
  # NCCL's communicator set-up (ncclCommInit*) probes its own kernels with cudaFuncGetAttributes and
  # handles the error it gets for those built for no image of this device: memcheck reports those
  # API errors. A run that exits with memcheck's error status, whose tests passed, and whose every
  # report is such an error raised inside ncclCommInit* leaves tigon's code clean.
  if [ "$tool" = memcheck ] && [ "$state" = errors ] && [ "$rc" = 9 ]; then
    local reports nccl total
    # Report blocks begin at an unindented "=== " line; a block counts as NCCL's when it is a
    # cudaFuncGetAttributes API error whose backtrace passes through ncclCommInit*.
    read -r reports nccl < <(awk '
      /^=+ [^ ]/ { inb = !/COMPUTE-SANITIZER|ERROR SUMMARY|Target application/
                   if (inb) { cur = b++; probe[cur] = /on CUDA API call to cudaFuncGetAttributes/ } }
      inb && probe[cur] && /ncclCommInit/ && !(cur in seen) { seen[cur] = 1; n++ }
      END { print b + 0, n + 0 }' "$f")
    total=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$f" | grep -oE '[0-9]+$' | head -1)
    extra=" (NCCL set-up's cudaFuncGetAttributes errors: $nccl of ${total:-?} reports)"
    [ "$nccl" -gt 0 ] && [ "$reports" = "$nccl" ] && [ "${total:-x}" = "$nccl" ] && grep -q "All tests passed" "$f" &&
      state=clean
  fi
  if [ "$tool" = racecheck ]; then
    local outside
    outside=$(grep -E '^=+ +at ' "$f" | grep -vc nvjet)
    extra=" (reports outside cuBLAS kernels: $outside)"
    # Reports only inside cuBLAS's kernels leave tigon's clean.
    [ "$state" = errors ] && [ "$outside" = 0 ] && grep -q "RACECHECK SUMMARY" "$f" && state=clean
  fi
  printf '%s\t%s\t%s\t%s\t%s s\t%s%s :: %s\n' "$tool" "$suite" "$name" "$state" "$(( $(date +%s) - s0 ))" "rc=$rc" \
    "$extra" "$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|All tests passed|test cases:|No tests ran' "$f" | tr '\n' ' ')"
}
results=$out/results.txt
: > "$results"
done_runs=${DONE:-}
while IFS=$'\t' read -r tool t name; do
  if [ -n "$done_runs" ] && [ -f "$done_runs" ]; then
    suite=$(basename "$t")
    awk -F'\t' -v a="$tool" -v b="${suite#tigon_gpu_tests_}" -v c="$name" \
      '$1 == a && $2 == b && $3 == c && $4 != "not started" { f = 1 } END { exit !f }' "$done_runs" && continue
  fi
  if [ "$deadline" -gt 0 ] && [ "$(date +%s)" -ge "$deadline" ]; then
    suite=$(basename "$t")
    printf '%s\t%s\t%s\tnot started\n' "$tool" "${suite#tigon_gpu_tests_}" "$name" >> "$results"
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  one "$tool" "$t" "$name" >> "$results" &
done < "$list"
wait
cat "$results"
awk -F'\t' '{ k = $1 " " $2; n[k]++; s[k "," $4]++ }
  END { for (k in n) printf "compute-sanitizer %s: %d cases, %d clean, %d with errors, %d stopped at the cap, %d not started\n",
        k, n[k], s[k ",clean"], s[k ",errors"], s[k ",stopped"], s[k ",not started"] }' "$results" | sort
