#!/usr/bin/env bash
# tigon's two entry points:
#   ./tigon.sh test    configure, build and run every test, C++ and Python (GPU tests report
#                      "skipped" without a GPU; the Python tests without torch, transformers and
#                      pytest in the active Python)
#   ./tigon.sh bench   configure, build and run the benchmarks against the copy ceiling of this GPU
# Prerequisites: the CUDA toolkit (12.x or 13.x), CMake >= 3.25, Ninja, Catch2 2.x, Google
# Benchmark. On Debian / Ubuntu the missing packages are installed (as root, or through sudo);
# elsewhere the exact line to run is printed. Python packages are never installed here (.ci/run
# sets up a virtual environment for CI).
set -euo pipefail
cd "$(dirname "$0")"
what=${1:-}
case "$what" in
  test|bench) ;;
  *) echo "usage: ./tigon.sh test|bench"; exit 2 ;;
esac

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-13.0/bin /usr/local/cuda-12/bin; do
    [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break
  done
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "tigon needs the CUDA toolkit (nvcc): https://developer.nvidia.com/cuda-downloads"; exit 1
fi
export CUDACXX=${CUDACXX:-$(command -v nvcc)}

have_pkg() {  # a CMake package or a header the build needs
  case "$1" in
    catch2) [ -f /usr/include/catch2/catch.hpp ] || [ -f /usr/local/include/catch2/catch.hpp ] ;;
    benchmark) ls /usr/lib/*/cmake/benchmark /usr/lib/cmake/benchmark /usr/local/lib/cmake/benchmark \
                  /usr/local/lib*/cmake/benchmark >/dev/null 2>&1 ;;
    ninja) command -v ninja >/dev/null 2>&1 ;;
    cmake) command -v cmake >/dev/null 2>&1 &&
           [ "$(printf '%s\n3.25\n' "$(cmake --version | head -1 | awk '{print $3}')" | sort -V | head -1)" = 3.25 ] ;;
  esac
}
declare -A debian=([catch2]=catch2 [benchmark]=libbenchmark-dev [ninja]=ninja-build [cmake]=cmake)
missing=()
for p in cmake ninja catch2 benchmark; do have_pkg "$p" || missing+=("${debian[$p]}"); done
if [ ${#missing[@]} -gt 0 ]; then
  line="apt-get update && apt-get install -y ${missing[*]}"
  if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null 2>&1; }; then
    echo "installing: ${missing[*]}"
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq && $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing prerequisites; install them with:"; echo "  $line"
    echo "(or point CMake at your own builds with Catch2_DIR / benchmark_DIR)"; exit 1
  fi
fi

exec cmake --workflow --preset "$what"
