"""Builds tigon_torch with its compiled operators (tigon_torch._C):

    pip install --no-build-isolation examples/torch      # MAX_JOBS=N compiles N files at a time

--no-build-isolation builds against the torch already installed (the extension must match it).
Environment: TORCH_CUDA_ARCH_LIST (default "9.0"), TIGON_INCLUDE_DIR, TIGON_TORCH_HIDDEN_SIZES (see
tigon_torch/_build.py).
"""

import importlib.util
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("tigon_torch_build", HERE / "tigon_torch" / "_build.py")
_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_build)


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
            sources=[str(p.relative_to(HERE)) for p in _build.source_paths()],
            include_dirs=includes,
            libraries=_build.libraries(),
            extra_compile_args={"cxx": _build.cxx_flags() + define, "nvcc": _build.nvcc_flags() + define},
        )
    ]


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(
    name="tigon_torch",
    version="0.1.0",
    description="PyTorch autograd functions and Hugging Face patches over tigon's fused training kernels",
    packages=find_packages(include=["tigon_torch", "tigon_torch.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4"],
    extras_require={"hf": ["transformers>=5.0"], "test": ["pytest", "transformers>=5.0"]},
    ext_modules=extensions(),
    cmdclass=cmdclass(),
)
