"""Shared by ops.py and e2e.py: which implementations can be imported here, the environment, JSON
and time-budget helpers. Importing this module needs neither a GPU, Liger-Kernel nor tigon_torch."""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def add_tigon_torch_to_path() -> None:
    """tigon_torch from the repository (examples/torch) when it is not installed."""
    try:
        importlib.import_module("tigon_torch")
        return
    except ImportError:
        pass
    path = str(REPO / "examples" / "torch")
    if path not in sys.path:
        sys.path.insert(0, path)


def probe_tigon(need_ops: bool) -> tuple[object | None, str]:
    """(tigon_torch module or None, why not). need_ops: also load the compiled operators (which
    needs CUDA and the built extension, or a JIT build)."""
    add_tigon_torch_to_path()
    try:
        tt = importlib.import_module("tigon_torch")
    except Exception as e:  # noqa: BLE001
        return None, f"import tigon_torch failed: {type(e).__name__}: {e}"
    if need_ops:
        try:
            how = tt.load()
        except Exception as e:  # noqa: BLE001
            return None, f"tigon_torch.load() failed: {type(e).__name__}: {e}"
        return tt, f"tigon_torch {getattr(tt, '__version__', '?')} ({how})"
    return tt, f"tigon_torch {getattr(tt, '__version__', '?')} (operators not loaded)"


LIGER_NAMES = {
    "rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "layer_norm": ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction"),
    "add_rms_norm": ("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"),
    "rope": ("liger_kernel.ops.rope", "LigerRopeFunction"),
    "swiglu": ("liger_kernel.ops.swiglu", "LigerSiLUMulFunction"),
    "geglu": ("liger_kernel.ops.geglu", "LigerGELUMulFunction"),
    "cross_entropy": ("liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction"),
    "linear_cross_entropy": ("liger_kernel.ops.fused_linear_cross_entropy", "LigerFusedLinearCrossEntropyFunction"),
    "jsd": ("liger_kernel.ops.jsd", "LigerJSDFunction"),
    "kl_div": ("liger_kernel.ops.kl_div", "LigerKLDivLossFunction"),
    "tvd": ("liger_kernel.ops.tvd", "LigerTVDLossFunction"),
    "fused_linear_jsd": ("liger_kernel.ops.fused_linear_jsd", "LigerFusedLinearJSDFunction"),
    "dpo": ("liger_kernel.chunked_loss", "LigerFusedLinearDPOLoss"),
    "medusa": ("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss"),
}


def probe_liger() -> tuple[dict[str, object], dict[str, str], str]:
    """({op: Liger autograd function}, {op: why missing}, a description). Liger-Kernel is found on
    sys.path (its source carried to the GPU machine, PYTHONPATH=<carried>/src) or installed."""
    found: dict[str, object] = {}
    missing: dict[str, str] = {}
    try:
        lk = importlib.import_module("liger_kernel")
    except Exception as e:  # noqa: BLE001
        why = f"import liger_kernel failed: {type(e).__name__}: {e}"
        return found, {op: why for op in LIGER_NAMES}, why
    for op, (mod, name) in LIGER_NAMES.items():
        try:
            found[op] = getattr(importlib.import_module(mod), name)
        except Exception as e:  # noqa: BLE001
            missing[op] = f"{mod}.{name}: {type(e).__name__}: {e}"
    where = os.path.dirname(getattr(lk, "__file__", "") or "?")
    version = "?"
    try:
        from importlib.metadata import version as _v

        version = _v("liger_kernel")
    except Exception:  # noqa: BLE001  (a source tree on PYTHONPATH has no metadata: its pyproject.toml)
        pyproject = Path(where).parent.parent / "pyproject.toml"
        if pyproject.is_file():
            for line in pyproject.read_text().splitlines():
                if line.startswith("version"):
                    version = line.split("=", 1)[1].strip().strip('"') + " (source)"
                    break
    return found, missing, f"liger_kernel {version} from {where}"


def environment() -> dict:
    env = {"python": sys.version.split()[0], "platform": platform.platform(),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            env["gpu"] = p.name
            env["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
    except Exception as e:  # noqa: BLE001
        env["torch"] = f"unavailable: {e}"
    for name in ("transformers", "triton"):
        try:
            env[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001
            env[name] = None
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "TIGON_TORCH_LCE_CHUNK", "TIGON_TORCH_HIDDEN_SIZES"):
        if os.environ.get(var):
            env[var] = os.environ[var]
    return env


class Budget:
    """Wall-clock budget: `left()` seconds remain of `seconds` (None: unlimited)."""

    def __init__(self, seconds: float | None):
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - self.elapsed()


def write_json(path: str | os.PathLike, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def back_to_back(call, reps: int) -> float:
    """The median over max(3, reps // 8) samples of the mean time of 20 back-to-back calls, in ms
    (CUDA events around the 20)."""
    import statistics

    import torch

    times = []
    for _ in range(max(3, reps // 8)):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            call()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 20)
    return statistics.median(times)
