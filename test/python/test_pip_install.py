"""tigon_torch's packaging as a user meets it (test/python/run.py packaging):

- without nvcc (PATH without the toolkit, CUDA_HOME an empty directory), `pip install
  --no-build-isolation examples/torch` installs the Python package with tigon's headers and the
  extension's sources inside it; it imports, patches LLaMA, and its JIT build takes its sources there;
- `pip wheel` builds a wheel with that content and complete metadata, and pip's isolated build
  environment gets no torch;
- with nvcc and a CUDA build of torch the compiled operators (tigon_torch._C) are installed and load;
  with a CPU-only torch (CI) the install is the Python package alone, and says why;
- one version: tigon/core/config.hpp's, in the package metadata and in tigon_torch.__version__.

Every install goes to a temporary directory (pip --target), never into the running environment.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "examples" / "torch"
sys.path.insert(0, str(PROJECT))
from tigon_torch import _build  # noqa: E402  (no torch import)

VERSION = _build.version()
NOT_COMPILED = "installing without the compiled operators"


def pip(*args: str, env: dict[str, str], check: bool = True) -> str:
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--disable-pip-version-check", "-v"],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if check and proc.returncode != 0:
        pytest.fail(f"pip {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc.stdout if check else f"rc={proc.returncode}\n{proc.stdout}"


def without_cuda(tmp: Path) -> dict[str, str]:
    """The environment with the CUDA toolkit out of sight: no nvcc on PATH, CUDA_HOME an empty directory
    (torch otherwise falls back to /usr/local/cuda)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not (Path(d) / "nvcc").exists())
    empty = tmp / "no-cuda"
    empty.mkdir(exist_ok=True)
    env["CUDA_HOME"] = str(empty)
    env.pop("CUDA_PATH", None)
    for var in ("TIGON_INCLUDE_DIR", "TIGON_TORCH_BUILD_EXT", "TIGON_TORCH_JIT"):
        env.pop(var, None)
    return env


def run_installed(target: Path, code: str, env: dict[str, str], cwd: Path) -> dict:
    """Runs code with only the installed copy of tigon_torch importable; returns the JSON it prints last."""
    env = dict(env, PYTHONPATH=str(target))
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHECK_INSTALLED = """
import json, pathlib
import tigon_torch
from tigon_torch import _build
tigon_torch.apply_tigon_to_llama()
from transformers.models.llama import modeling_llama
patched = modeling_llama.LlamaRMSNorm.__module__
tigon_torch.unpatch()
print(json.dumps({
    "file": tigon_torch.__file__, "version": tigon_torch.__version__, "header_version": _build.version(),
    "include": str(_build.include_dir()), "csrc": str(_build.CSRC_DIR),
    "sources": [str(p) for p in _build.source_paths()], "patched": patched,
    "restored": modeling_llama.LlamaRMSNorm.__module__,
}))
"""


@pytest.fixture(scope="module")
def python_only(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("python-only")
    env = without_cuda(tmp)
    target = tmp / "site"
    out = pip("install", "--no-build-isolation", "--target", str(target), str(PROJECT), env=env)
    return tmp, env, target, out


def test_build_requirements_leave_torch_out():
    text = (PROJECT / "pyproject.toml").read_text()
    requires = re.search(r"^requires\s*=\s*\[(.*?)\]", text, re.MULTILINE | re.DOTALL).group(1)
    names = [re.split(r"[<>=!~ \[]", r.strip().strip("\"'"))[0] for r in requires.split(",") if r.strip()]
    assert "torch" not in names, names


def test_install_without_nvcc_is_python_only(python_only):
    _, _, target, out = python_only
    assert NOT_COMPILED in out and "no CUDA toolkit found" in out
    package = target / "tigon_torch"
    assert not list(package.glob("_C*")), "a compiled extension was installed without nvcc"
    assert (package / "include" / "tigon" / "tigon.cuh").is_file()
    assert (package / "include" / "tigon" / "core" / "config.hpp").is_file()
    for source in _build.SOURCES:
        assert (package / "csrc" / source).is_file(), source


def test_python_only_install_imports_patches_and_finds_its_sources(python_only):
    tmp, env, target, _ = python_only
    got = run_installed(target, CHECK_INSTALLED, env, cwd=tmp)
    package = target / "tigon_torch"
    assert Path(got["file"]).parent == package
    assert Path(got["include"]) == package / "include"
    assert Path(got["csrc"]) == package / "csrc"
    assert all(Path(s).parent == package / "csrc" and Path(s).is_file() for s in got["sources"])
    assert got["patched"].startswith("tigon_torch"), got["patched"]
    assert got["restored"].startswith("transformers"), got["restored"]
    assert got["header_version"] == VERSION
    assert got["version"] == VERSION, "tigon_torch.__version__ differs from tigon/core/config.hpp's version"


def test_shipped_sources_include_only_shipped_files(python_only):
    """The JIT build of an installed package needs nothing from the repository: every quoted include of
    csrc/ and every <tigon/...> include resolves inside the package (but tigon/hidden_sizes.hpp, which
    CMake generates and dispatch.hpp includes only then)."""
    _, _, target, _ = python_only
    package = target / "tigon_torch"
    include, csrc = package / "include", package / "csrc"
    files = list(csrc.iterdir()) + [p for p in include.rglob("*") if p.is_file()]
    missing = []
    for f in files:
        for quoted, angled in re.findall(r'^\s*#\s*include\s*(?:"([^"]+)"|<(tigon/[^>]+)>)', f.read_text(), re.M):
            if angled == "tigon/hidden_sizes.hpp":
                continue
            if quoted:
                found = any((d / quoted).is_file() for d in (f.parent, csrc, include))
            else:
                found = (include / angled).is_file()
            if not found:
                missing.append(f"{f.relative_to(package)}: {quoted or angled}")
    assert not missing, missing


def test_required_compiled_operators_fail_clearly_without_nvcc(tmp_path):
    env = dict(without_cuda(tmp_path), TIGON_TORCH_BUILD_EXT="1")
    out = pip("install", "--no-build-isolation", "--target", str(tmp_path / "site"), str(PROJECT), env=env,
              check=False)
    assert not out.startswith("rc=0"), out[-3000:]
    assert "the operators cannot be compiled: no CUDA toolkit found" in out, out[-3000:]


def _check_wheel(path: Path, pure: bool) -> None:
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        info = f"tigon_torch-{VERSION}.dist-info"
        meta = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        wheel_info = whl.read(f"{info}/WHEEL").decode()
    for f in ("tigon_torch/__init__.py", "tigon_torch/include/tigon/tigon.cuh", "tigon_torch/csrc/bind.cpp"):
        assert f in names, f
    assert any(n.startswith(f"{info}/") and n.endswith("/LICENSE") for n in names), "no LICENSE in the wheel"
    assert meta["Version"] == VERSION
    assert "Apache-2.0" in (meta["License"], meta["License-Expression"])
    assert meta["Author"] == "tigon developers"
    assert meta["Home-page"].startswith("https://")
    assert meta["Summary"]
    assert "License :: OSI Approved :: Apache Software License" in meta.get_all("Classifier")
    assert ("Tag: py3-none-any" in wheel_info) == pure, wheel_info


def test_pip_wheel_without_nvcc(tmp_path):
    env = without_cuda(tmp_path)
    pip("wheel", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(PROJECT), env=env)
    (wheel,) = (tmp_path / "dist").glob("tigon_torch-*.whl")
    _check_wheel(wheel, pure=True)


def test_isolated_build_pulls_no_torch(tmp_path):
    """`pip wheel examples/torch` with pip's build isolation: setuptools and wheel from the index, no torch."""
    env = without_cuda(tmp_path)
    out = pip("wheel", "-w", str(tmp_path / "dist"), str(PROJECT), env=env, check=False)
    if not out.startswith("rc=0") and re.search(r"(No matching distribution|Could not find a version|"
                                                r"Failed to establish a new connection)", out):
        pytest.skip("no package index reachable for pip's isolated build environment")
    assert out.startswith("rc=0"), out[-6000:]
    collected = re.findall(r"^\s*Collecting (\S+)", out, re.M)
    assert not [c for c in collected if re.match(r"torch\b", c)], collected
    (wheel,) = (tmp_path / "dist").glob("tigon_torch-*.whl")
    _check_wheel(wheel, pure=True)


def test_install_with_nvcc(tmp_path):
    """With nvcc: the compiled operators where torch is a CUDA build; the Python package alone, saying so,
    where torch is a CPU-only build (CI's). TIGON_TORCH_HIDDEN_SIZES defaults to "none" here (the
    general kernels only) to keep the build short."""
    torch = pytest.importorskip("torch")
    from torch.utils import cpp_extension

    if not cpp_extension.CUDA_HOME or not (Path(cpp_extension.CUDA_HOME) / "bin" / "nvcc").is_file():
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    env = dict(os.environ)
    env.setdefault("TIGON_TORCH_HIDDEN_SIZES", "none")
    for var in ("TIGON_INCLUDE_DIR", "TIGON_TORCH_BUILD_EXT", "TIGON_TORCH_JIT"):
        env.pop(var, None)
    target = tmp_path / "site"
    out = pip("install", "--no-build-isolation", "--target", str(target), str(PROJECT), env=env)
    package = target / "tigon_torch"
    if torch.version.cuda is None:
        assert NOT_COMPILED in out and "CPU-only build" in out, out[-3000:]
        assert not list(package.glob("_C*"))
        return
    assert NOT_COMPILED not in out
    assert list(package.glob("_C*.so")), "no compiled extension installed"
    got = run_installed(target, """
import json, tigon_torch
from tigon_torch import _ext
how = tigon_torch.load()
print(json.dumps({"how": how, "op": _ext._ops_registered()}))
""", env, cwd=tmp_path)
    assert got == {"how": "installed", "op": True}, got
