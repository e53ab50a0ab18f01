"""OOM forensics (jaxmem.plan.oom, report_oom): XLA's message parsed to exact bytes, the levers that free the
missing bytes ranked by added step time, and oom_report.json. No compiles: explain() is stubbed."""
import dataclasses
import io
import json

import jax
import pytest

from jaxmem.loader import load_config
from jaxmem.plan import explain as explain_mod
from jaxmem.plan import oom
from jaxmem.config.targets import TARGETS

GIB = 2**30
# Recorded on an H100 (jax 0.11.2).
H100 = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.02GiB with allocator GPU_0_bfc on device 0. "
        "[tf-allocator-allocation-error='']")
AUTOTUNE = ("NOT_FOUND: All configs failed during profiling or were excluded from selection.\nFailures (3):\n"
            "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.02GiB with allocator "
            "GPU_0_bfc on device 0.")


@pytest.mark.parametrize("text, asked, free, form", [
    (H100, round(8.02 * GIB), None, "pjrt_bfc"),
    (AUTOTUNE, round(8.02 * GIB), None, "pjrt_bfc"),
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8606711808 bytes.", 8606711808, None, "pjrt_bfc"),
    ("Out of memory allocating 123456789 bytes.", 123456789, None, "jaxlib"),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 8.02GiB (8606711808B) on device ordinal 0",
     8606711808, None, "stream_executor"),
    ("Allocator (GPU_0_bfc) ran out of memory trying to allocate 512.5MiB (rounded to 537395200)requested by op",
     537395200, None, "bfc_rounded"),
    ("Out of memory while trying to allocate 3.00GiB; 1073741824 bytes free, 80.00GiB total", 3 * GIB, GIB,
     "pjrt_bfc"),
    ("Out of memory while trying to allocate 700KiB, 12.5MiB free", 700 * 1024, round(12.5 * 2**20), "pjrt_bfc"),
    ("Out of memory while trying to allocate 96B", 96, None, "pjrt_bfc"),
])
def test_parse_allocation_messages(text, asked, free, form):
    m = oom.parse_oom(text)
    assert (m.asked_bytes, m.free_bytes, m.form) == (asked, free, form)
    assert m.missing_bytes == (None if free is None else max(0, asked - free))  # free > asked: fragmentation


def test_parse_remat_limit():
    text = ("RESOURCE_EXHAUSTED: Can't reduce memory use below 70.00GiB (75161927680 bytes) by rematerialization; "
            "only reduced to 80.00GiB (85899345920 bytes), down from 90.00GiB (96636764160 bytes) originally")
    m = oom.parse_oom(text)
    assert (m.limit_bytes, m.peak_bytes, m.form) == (75161927680, 85899345920, "remat_limit")
    assert m.missing_bytes == 85899345920 - 75161927680
    assert oom.parse_oom("shape mismatch").form == ""


@pytest.fixture
def tiny_gpu(monkeypatch):
    """A test-only 8 GiB GPU (the H100's rates), registered as a target."""
    gpu = dataclasses.replace(TARGETS["h100-80g"], name="test-8g", hbm_bytes=8 * GIB)
    monkeypatch.setitem(TARGETS, "test-8g", gpu)
    return gpu


@pytest.fixture
def big_cfg(tiny_gpu, tmp_path):
    """A config planned over the 8 GiB target (~8.1 GiB vs a 6 GiB limit): a wide model, no remat, naive loss,
    fp32 state, zero 1; four levers each free the missing ~2.1 GiB."""
    return load_config("configs/tiny.yaml", [
        "model.d_model=2048", "model.d_ff=5632", "model.n_heads=16", "model.n_kv_heads=16", "model.n_layers=8",
        "model.vocab_size=65536", "model.max_seq_len=2048", "train.seq_len=512", "train.micro_batch=2",
        "kernels.loss=naive", "kernels.attention=xla", "parallel.zero_stage=1", "target.name=test-8g",
        "target.gpus_per_host=8", f"out_dir={tmp_path / 'run'}"])


def test_levers_free_the_missing_bytes_cheapest_first(big_cfg, tiny_gpu):
    limit = (int(tiny_gpu.hbm_bytes * 0.75), "test")
    rep = oom.forensics(big_cfg, H100, 8, tiny_gpu, limit)
    assert rep["bill"]["device_total"] > limit[0]
    assert rep["missing_bytes"] == rep["bill"]["device_total"] - limit[0]
    assert "estimated (analytic)" in rep["missing_label"] and rep["bill"]["label"] == "estimated (analytic)"
    levers = rep["levers"]
    assert levers and rep["levers_cover_missing"]
    assert all(x["frees_bytes"] >= rep["missing_bytes"] for x in levers)
    added = [x["added_step_seconds"] for x in levers]
    assert added == sorted(added)
    assert all(x["bytes_label"] == "estimated (analytic)" and x["time_label"] == "estimated (cost model)"
               for x in levers)


def test_levers_fall_back_to_the_three_biggest(big_cfg, tiny_gpu):
    levers, covers = oom.rank_levers(big_cfg, 8, tiny_gpu, missing=10**15)
    assert not covers and len(levers) == 3
    assert [x["added_step_seconds"] for x in levers] == sorted(x["added_step_seconds"] for x in levers)


def test_report_oom_writes_the_json(big_cfg, tiny_gpu, monkeypatch):
    calls = []
    monkeypatch.setattr(explain_mod, "explain", lambda cfg, topo, top: calls.append(topo.label) or {
        "peak_live_bytes": 10 * GIB, "label": "stub", "memory_usage_report": "",
        "buffers": [{"bytes": GIB, "shape": [2, 512, 65536], "dtype": "f32", "category": "logits",
                     "checkpoint_name": "", "why": "", "source": "x.py:1", "suggestion": "kernels.loss=chunked"}]})
    monkeypatch.setattr(oom, "allocator_limit", lambda gpu: (int(gpu.hbm_bytes * 0.75), "assumed: test"))
    out = io.StringIO()
    try:
        raise RuntimeError("out of device memory while running the train step") from RuntimeError(AUTOTUNE)
    except RuntimeError as e:
        assert explain_mod.report_oom(big_cfg, e, top=3, file=out)
    print(out.getvalue())
    rep = json.loads((tmp := __import__("pathlib").Path(big_cfg.out_dir) / "oom_report.json").read_text())
    assert rep["parsed"]["asked_bytes"] == round(8.02 * GIB) and rep["parsed"]["form"] == "pjrt_bfc"
    assert rep["bill"]["device_total"] > 6 * GIB and rep["levers"] and rep["explain"]["label"] == "stub"
    assert calls == [f"{jax.device_count()} x test-8g"] and tmp.exists()  # the run's devices, on test-8g
    assert "levers that free the missing bytes" in out.getvalue() and "8.02 GiB" in out.getvalue()


def test_report_oom_ignores_other_errors(big_cfg):
    assert not explain_mod.report_oom(big_cfg, ValueError("shape mismatch"), file=io.StringIO())
    assert not (__import__("pathlib").Path(big_cfg.out_dir) / "oom_report.json").exists()
