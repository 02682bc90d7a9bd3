"""Runs tigon's Python suites for ctest (test/CMakeLists.txt), from the repository root:

    python test/python/run.py torch       examples/torch/tests: the tests that run on this machine;
                                          without a CUDA device the GPU tests report skipped
    python test/python/run.py packaging   test/python: pip install / pip wheel of examples/torch,
                                          with and without nvcc, and the installed package's import

Extra arguments go to pytest. Exits 77 (ctest: skipped) when torch, transformers or pytest is
missing (for the packaging suite also wheel, with setuptools before 70.1), unless
TIGON_REQUIRE_PYTHON_TESTS=1 (CI), which makes that a failure.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SUITES = {"torch": ROOT / "examples" / "torch" / "tests", "packaging": HERE}


def _setuptools_has_bdist_wheel() -> bool:
    return importlib.util.find_spec("setuptools.command.bdist_wheel") is not None


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in SUITES:
        print(f"usage: {sys.argv[0]} {'|'.join(SUITES)} [pytest arguments]", file=sys.stderr)
        return 2
    missing = [m for m in ("torch", "transformers", "pytest") if importlib.util.find_spec(m) is None]
    if sys.argv[1] == "packaging" and importlib.util.find_spec("wheel") is None and not _setuptools_has_bdist_wheel():
        missing.append("wheel")  # pip --no-build-isolation with setuptools before 70.1
    if missing:
        required = os.environ.get("TIGON_REQUIRE_PYTHON_TESTS", "") not in ("", "0")
        print(f"{sys.executable} lacks {', '.join(missing)}: "
              f"{'failing (TIGON_REQUIRE_PYTHON_TESTS=1)' if required else 'skipped'}; "
              f"install them with `pip install {' '.join(missing)}`")
        return 1 if required else 77
    env = dict(os.environ)
    env.pop("TIGON_TORCH_REFERENCE_OPS", None)  # the kernels' suite as it is, GPU tests skipped
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", str(SUITES[sys.argv[1]]), "-p", "no:cacheprovider", "-q", "-rfE"]
    if sys.argv[1] == "torch":
        cmd += ["-p", "tigon_gpu_guard"]
    cmd += sys.argv[2:]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
