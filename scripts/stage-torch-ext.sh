#!/usr/bin/env bash
# Build the PyTorch extension's operator library on a machine without a GPU, for a GPU machine
# whose PyTorch is the same build, so that no build runs there:
#   scripts/stage-torch-ext.sh [DEST]            (default .prebuilt/torch, git-ignored)
# Needs a Python with the same PyTorch as the GPU machine (e.g. `pip install torch==2.11.0`, the
# CUDA 13.0 build PyPI serves, which imports without a GPU), the CUDA toolkit and ninja.
# TORCH_PYTHON picks the Python (default: python3); TIGON_TORCH_HIDDEN_SIZES the compiled hidden
# sizes (default 2048,4096,8192); TORCH_CUDA_ARCH_LIST the architectures (default 9.0).
# Writes DEST/tigon_torch_ops.so (torch.utils.cpp_extension, not a Python module, so it loads in
# any Python version) and DEST/site/sitecustomize.py, which loads the library at every Python
# start-up when TIGON_PRELOAD names it. On the GPU machine:
#   export PYTHONPATH=$PWD/DEST/site:$PWD/examples/torch TIGON_PRELOAD=$PWD/DEST/tigon_torch_ops.so
# and tigon_torch.load() reports "preloaded" (bench/compare/README.md).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$here/.prebuilt/torch}
py=${TORCH_PYTHON:-python3}
mkdir -p "$dest/site"
dest=$(cd "$dest" && pwd)
build=$(mktemp -d)
export TIGON_TORCH_BUILD_DIR=$build
export TIGON_TORCH_HIDDEN_SIZES=${TIGON_TORCH_HIDDEN_SIZES:-2048,4096,8192}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH=$CUDA_HOME/bin:$PATH
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
(cd "$here/examples/torch" && PYTHONPATH=$PWD "$py" -c "import tigon_torch._ext as e; e.jit_build()")
cp "$build/tigon_torch_ops.so" "$dest/"
cat > "$dest/site/sitecustomize.py" <<'PY'
# Loads tigon's operator library (TIGON_PRELOAD) at Python start-up: see scripts/stage-torch-ext.sh.
import os

if os.environ.get("TIGON_PRELOAD"):
    import torch

    torch.ops.load_library(os.environ["TIGON_PRELOAD"])
PY
rm -rf "$build"
echo "staged $dest/tigon_torch_ops.so ($(du -m "$dest/tigon_torch_ops.so" | cut -f1) MiB) in $(( $(date +%s) - start )) s"
