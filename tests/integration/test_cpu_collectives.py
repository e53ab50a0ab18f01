"""`jaxmem train` on virtual CPU devices with only the user's flags: the step's independent collectives do not
deadlock on XLA:CPU's shared thread pool (jaxmem.cli._cpu_thread_pool sizes it before the backend starts)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem import cli

ROOT = Path(__file__).resolve().parents[2]


def test_the_thread_pool_gets_room_for_every_devices_collectives(monkeypatch):
    if os.path.exists("/proc/driver/nvidia"):
        pytest.skip("a GPU host: the CPU pool is left alone")
    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    cli._cpu_thread_pool()
    assert os.environ["NPROC"] == str(max(os.cpu_count(), 8 * cli.THREADS_PER_DEVICE))
    monkeypatch.setenv("NPROC", "3")
    cli._cpu_thread_pool()  # the user's own setting wins
    assert os.environ["NPROC"] == "3"
    monkeypatch.delenv("NPROC")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    cli._cpu_thread_pool()  # one device: no collectives to wait in
    assert "NPROC" not in os.environ


@pytest.mark.slow
def test_a_moe_step_over_eight_cpu_devices_trains_with_the_users_flags_only(tmp_path):
    """Without the pool's room, half the devices waited in the layer scan's all-gather and half in the LM
    head's until XLA aborted the process after 40 s; the suite's own XLA flags and its
    JAX_DISABLE_MOST_OPTIMIZATIONS are left out, so the step is the one a user's command compiles."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC", "JAX_DISABLE_MOST_OPTIMIZATIONS")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", "configs/tiny.yaml", "model.n_experts=8",
           "model.experts_per_token=2", "train.global_batch=16", "parallel.fsdp=8", f"out_dir={out}",
           "train.steps=3", "train.log_every=1", "train.progress=false", "checkpoint.enabled=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
