#!/usr/bin/env bash
# Same-process before/after of the cross-entropy (loss + gradient in place, mean, bf16): this tree's
# cross_entropy() and that of commit REV in one binary, on the same buffers, alternating, with the
# copy rate of the same buffers (buffer placement and process state then cannot tell them apart).
# REV's tree is checked out into a temporary worktree (or REV names a folder that holds that tree,
# e.g. `git archive REV | tar -x -C DIR`, where no repository is at hand) and compiled with its version
# namespace renamed (-Dv0_1=vbefore), so that both versions' kernels link side by side.
#   scripts/probes/ce_before_after/build.sh REV|DIR OUT [VARIANT_INCLUDE...]
#   then, on a GPU: OUT [rounds, default 5]
# Each VARIANT_INCLUDE (up to four: include folders of trees changed for a hypothesis) is built as a
# further version, v1 .. v4, timed in the same rounds.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
rev=${1:?usage: build.sh REV OUT [VARIANT_INCLUDE...]}
out=${2:?usage: build.sh REV OUT [VARIANT_INCLUDE...]}
shift 2
[ $# -le 4 ] || { echo "at most four variants"; exit 2; }
tmp=$(mktemp -d)
if [ -d "$rev/include/tigon" ]; then
  before=$(cd "$rev" && pwd)
  trap 'rm -rf "$tmp"' EXIT
else
  before=$tmp/before
  trap 'git -C "$root" worktree remove --force "$tmp/before" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
  git -C "$root" worktree add --detach "$before" "$rev" >/dev/null
fi
flags=(-std=c++20 -O3 -arch=${ARCH:-sm_90} --expt-relaxed-constexpr)
nvcc "${flags[@]}" -I"$root/include" -DAB_NAME=ce_head -c "$here/ce_version.cu" -o "$tmp/head.o"
nvcc "${flags[@]}" -I"$before/include" -Dv0_1=vbefore -DAB_NAME=ce_before -c "$here/ce_version.cu" -o "$tmp/before.o"
objs=("$tmp/main.o" "$tmp/head.o" "$tmp/before.o")
k=0
for inc in "$@"; do
  k=$((k + 1))
  nvcc "${flags[@]}" -I"$inc" -Dv0_1=vvariant$k -DAB_NAME=ce_v$k -c "$here/ce_version.cu" -o "$tmp/v$k.o"
  objs+=("$tmp/v$k.o")
done
nvcc "${flags[@]}" -c "$here/ce_ab.cu" -o "$tmp/main.o"
nvcc -arch=${ARCH:-sm_90} "${objs[@]}" -o "$out"
echo "built $out (this tree against $rev${1:+, with $# variant(s)})"
