"""bench/compare on the CPU: e2e.py's dry run (a 2-layer model, one process per variant) writes its
per-step losses and ratios, its profile helpers classify kernels and measure the device's idle time,
and ops.py's smoke scale runs an eager row. What the GPU runs of these scripts rely on, checked where
no GPU is needed, so that a broken script does not cost a GPU call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

COMPARE = Path(__file__).resolve().parents[3] / "bench" / "compare"


def _e2e():
    sys.path.insert(0, str(COMPARE))
    try:
        import e2e
    finally:
        sys.path.remove(str(COMPARE))
    return e2e


def test_device_idle_merges_overlaps_and_lists_gaps():
    e2e = _e2e()
    span, busy, gaps = e2e.device_idle([(20, 30, "c"), (0, 10, "a"), (5, 12, "b"), (31, 40, "d"), (32, 35, "e")])
    assert span == 40
    assert busy == 12 + 10 + 9
    assert sorted(gaps) == [(1, "c", "d"), (8, "b", "c")]
    assert e2e.device_idle([]) == (0.0, 0.0, [])


def test_clock_sampler_summary_and_no_device():
    e2e = _e2e()
    idle = e2e.ClockSampler("cpu")  # no GPU: nothing is started and nothing is sampled
    idle.start()
    idle.stop()
    assert idle.cmd is None and idle.samples == [] and idle.summary() == {}
    s = e2e.ClockSampler("cpu")
    s.samples = [(1980.0, 650.5, 61.0), (1755.0, 699.5, 64.0), (1830.0, 690.0, 63.0)]
    assert s.summary() == {"sm_mhz_median": 1830.0, "sm_mhz_min": 1755.0, "power_w_mean": 680.0,
                           "temp_c_max": 64.0, "samples": 3}


@pytest.mark.parametrize("name, category", [
    ("void tigon::v0_1::detail::adamw_step_kernel<__nv_bfloat16, __nv_bfloat16, tigon::v0_1::AdamWRule>", "tigon AdamW"),
    ("void tigon::v0_1::detail::add_rms_norm_bwd_kernel<__nv_bfloat16>", "tigon RMSNorm, add + RMSNorm"),
    ("void tigon::v0_1::detail::grad_norm_kernel<__nv_bfloat16>", "tigon, other"),
    ("void tigon::v0_1::detail::ce_resident_kernel<__nv_bfloat16, long, 8>", "tigon linear cross-entropy + cross-entropy"),
    ("void tigon::v0_1::detail::gated_fwd_flat_kernel<__nv_bfloat16, tigon::v0_1::Silu, 8, 2, true>", "tigon SwiGLU"),
    ("void tigon::v0_1::detail::rope_heads_kernel<__nv_bfloat16>", "tigon RoPE"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM"),
    ("void at::native::multi_tensor_apply_kernel<at::native::FusedOptimizerTensorListMetadata<4>>", "torch AdamW"),
    ("Memset (Device)", "elementwise, copies, fills"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", "elementwise, copies, fills"),
])
def test_profile_categories(name, category):
    assert _e2e().category(name) == category


def test_e2e_dry_run(tmp_path):
    out = tmp_path / "e2e"
    r = subprocess.run([sys.executable, str(COMPARE / "e2e.py"), "--dry", "--out", str(out), "--phases", "train",
                        "--variants", "hf,tigon"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads((out / "e2e.json").read_text())
    train = summary["results"]["train"]
    assert set(train) == {"hf", "tigon"}
    for variant, res in train.items():
        assert "error" not in res and "unavailable" not in res, (variant, res)
        assert res["optimizer"].startswith("torch.optim.AdamW")  # on the CPU every variant steps with torch's
        for run in res["runs"]:
            assert len(run["losses"]) == 3 and all(v == v for v in run["losses"]), run
            assert run["tokens_per_s"] > 0
    assert {"tigon@64", "tigon@128"} <= set(summary["comparison"])
    assert "| 64 | tigon |" in (out / "e2e.md").read_text()


def test_ops_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(COMPARE / "ops.py"), "--device", "cpu", "--scale", "0.02", "--ops",
                        "rms_norm", "--impls", "eager", "--modes", "fwd", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "ops.json").read_text())["rows"]
    assert rows and all(row["op"] == "rms_norm" and row["ms"] > 0 for row in rows)
