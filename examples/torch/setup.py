"""Builds tigon_torch: the Python package, with tigon's headers and the extension's sources inside it,
and the compiled operators (tigon_torch._C) when the build can compile them.

    pip install --no-build-isolation examples/torch   # compiled against the installed torch when
                                                      # nvcc is found; MAX_JOBS=N: N files at a time
    pip install examples/torch                        # Python only: pip's isolated build environment
                                                      # has no torch to compile against
    pip wheel --no-build-isolation examples/torch     # the same, as a wheel

Without the compiled operators the package imports and patches models as usual, and compiles the
operators on first use (tigon_torch.load(): a JIT build with the shipped headers; nvcc and ninja then).

Environment:
  TIGON_TORCH_BUILD_EXT     auto (default): compile when torch with CUDA and nvcc are there; 1: compile
                            or fail, saying why; 0: Python only.
  TORCH_CUDA_ARCH_LIST      CUDA architectures (default "9.0"); TIGON_INCLUDE_DIR,
                            TIGON_TORCH_HIDDEN_SIZES: see tigon_torch/_build.py.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("tigon_torch_build", HERE / "tigon_torch" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)

CSRC_SUFFIXES = (".cpp", ".cu", ".h")


def why_not_compiled() -> str | None:
    """None when the operators can be compiled here, else the reason."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return ("torch is not importable in the build environment (pip's build isolation: "
                "`pip install --no-build-isolation` compiles against the installed torch)")
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    home = cpp_extension.CUDA_HOME
    if not home or not (Path(home) / "bin" / "nvcc").is_file():
        return "no CUDA toolkit found (nvcc under $CUDA_HOME, on PATH or in /usr/local/cuda)"
    return None


def compile_operators() -> bool:
    mode = os.environ.get("TIGON_TORCH_BUILD_EXT", "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        print("tigon_torch: Python only (TIGON_TORCH_BUILD_EXT=0)", file=sys.stderr)
        return False
    reason = why_not_compiled()
    if reason is None:
        return True
    if mode in ("1", "on", "yes", "true"):
        raise SystemExit(f"tigon_torch: TIGON_TORCH_BUILD_EXT={mode} but the operators cannot be compiled: {reason}")
    print(f"tigon_torch: installing without the compiled operators ({reason}); they compile on first use",
          file=sys.stderr)
    return False


def extensions():
    from torch.utils.cpp_extension import CUDAExtension

    _build.ensure_arch_list()
    includes = [str(_build.include_dir()), str(_build.CSRC_DIR)]
    generated = _build.hidden_sizes_dir(HERE / "build")
    if generated is not None:
        includes.append(str(generated))
    define = ["-DTIGON_TORCH_PYTHON_MODULE"]
    return [
        CUDAExtension(
            name="tigon_torch._C",
            sources=[os.path.relpath(p, HERE) for p in _build.source_paths()],
            include_dirs=includes,
            libraries=_build.libraries(),
            extra_compile_args={"cxx": _build.cxx_flags() + define, "nvcc": _build.nvcc_flags() + define},
        )
    ]


class BuildPyWithSources(build_py):
    """Also copies tigon's headers and csrc/ into the package, for the JIT build of an installed package."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "tigon_torch"
        if not self.distribution.ext_modules:  # no compiled operators left from an earlier build
            for stale in package.glob("_C*"):
                stale.unlink()
        include = package / "include" / "tigon"
        shutil.rmtree(include, ignore_errors=True)
        shutil.copytree(_build.include_dir() / "tigon", include)
        csrc = package / "csrc"
        shutil.rmtree(csrc, ignore_errors=True)
        csrc.mkdir(parents=True)
        for f in sorted(_build.CSRC_DIR.iterdir()):
            if f.suffix in CSRC_SUFFIXES:
                shutil.copy2(f, csrc / f.name)


cmdclass = {"build_py": BuildPyWithSources}
ext_modules = []
if compile_operators():
    from torch.utils.cpp_extension import BuildExtension

    ext_modules = extensions()
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(
    name="tigon_torch",
    version=_build.version(),
    description="PyTorch autograd functions and Hugging Face patches over tigon's fused training kernels",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    author="tigon developers",
    url="https://github.com/tigon-developers/tigon",
    license="Apache-2.0",
    license_files=["LICENSE"],
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Programming Language :: C++",
        "Environment :: GPU :: NVIDIA CUDA",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    packages=find_packages(include=["tigon_torch", "tigon_torch.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={"hf": ["transformers>=5.0"], "test": ["pytest", "transformers>=5.0"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
