"""pytest plugin for tigon_torch's suite on a machine without a CUDA device (test/python/run.py loads
it): tests marked `gpu` or `cuda_only` report skipped, and one that passes there fails the session,
since it checks nothing. Does nothing where CUDA is available or in the CPU reference mode
(TIGON_TORCH_REFERENCE_OPS=1)."""

from __future__ import annotations

import os

import pytest

_ACTIVE = False
_passed: list[str] = []
_skipped = 0


def pytest_configure(config):
    global _ACTIVE
    import torch

    _ACTIVE = not torch.cuda.is_available() and os.environ.get("TIGON_TORCH_REFERENCE_OPS") != "1"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not _ACTIVE:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda_only" in item.keywords and "gpu" not in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    global _skipped
    if not _ACTIVE or not ("gpu" in report.keywords or "cuda_only" in report.keywords):
        return
    if report.when == "call" and report.passed:
        _passed.append(report.nodeid)
    elif report.skipped:
        _skipped += 1


def pytest_terminal_summary(terminalreporter):
    if not _ACTIVE:
        return
    terminalreporter.write_line(f"tigon_gpu_guard: {_skipped} GPU tests skipped without a CUDA device")
    for nodeid in _passed:
        terminalreporter.write_line(f"tigon_gpu_guard: GPU test passed without a CUDA device: {nodeid}", red=True)


def pytest_sessionfinish(session, exitstatus):
    if _ACTIVE and _passed and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
