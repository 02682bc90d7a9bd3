"""Loads the compiled operators (torch.ops.tigon.*): the extension built by pip (tigon_torch._C) when
present, else a JIT build with torch.utils.cpp_extension.load (ninja and nvcc needed; no network).

The JIT build goes to $TIGON_TORCH_BUILD_DIR, or torch's extension cache, and is reused until a
source changes. TIGON_TORCH_JIT=1 forces it even when tigon_torch._C is installed;
TIGON_TORCH_VERBOSE=1 prints the compiler commands.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from . import _build

_lock = threading.Lock()
_loaded: str | None = None


def _ops_registered() -> bool:
    try:
        torch.ops.tigon.rms_norm_fwd.default  # noqa: B018
        return True
    except (AttributeError, RuntimeError):
        return False


def jit_build(verbose: bool | None = None) -> str:
    """Compiles the extension with torch.utils.cpp_extension.load and loads it; returns the library path."""
    from torch.utils import cpp_extension

    if verbose is None:
        verbose = os.environ.get("TIGON_TORCH_VERBOSE", "") not in ("", "0")
    _build.ensure_arch_list()
    build_root = os.environ.get("TIGON_TORCH_BUILD_DIR")
    if build_root:
        build_dir = Path(build_root)
    else:
        build_dir = Path(cpp_extension._get_build_directory("tigon_torch_ops", verbose=False))
    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [str(_build.include_dir()), str(_build.CSRC_DIR)]
    generated = _build.hidden_sizes_dir(build_dir)
    if generated is not None:
        includes.append(str(generated))
    cpp_extension.load(
        name="tigon_torch_ops",
        sources=[str(p) for p in _build.source_paths()],
        extra_include_paths=includes,
        extra_cflags=_build.cxx_flags(),
        extra_cuda_cflags=_build.nvcc_flags(),
        extra_ldflags=[f"-l{lib}" for lib in _build.libraries()],
        build_directory=str(build_dir),
        is_python_module=False,
        with_cuda=True,
        verbose=verbose,
    )
    return str(build_dir)


def load() -> str:
    """Makes torch.ops.tigon available; returns how ("installed" or the JIT build directory)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        force_jit = os.environ.get("TIGON_TORCH_JIT", "") not in ("", "0")
        if not force_jit:
            try:
                from . import _C  # noqa: F401  (registers the operators)

                _loaded = "installed"
            except ImportError:
                pass
        if _loaded is None:
            if _ops_registered():
                _loaded = "preloaded"
            else:
                _loaded = jit_build()
        return _loaded
