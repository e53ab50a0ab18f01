"""The first hour on a CPU machine: the README's CLI examples run as written (the CLI gives XLA the devices the
mesh takes), output piped to a file is one line per logged step, and nothing from the CUDA plugin reaches
stderr (`jaxmem --version`, a run, `jaxmem.load_hf` from Python); `jaxmem --help` loads no jax."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem.config import ModelConfig
from jaxmem.io.hf import save_hf
from jaxmem.model import init_model
from jaxmem.model.presets import resolve_model
from jaxmem.runtime.cpu_host import has_gpu

ROOT = Path(__file__).resolve().parents[2]
COUNT_FLAG = "--xla_force_host_platform_device_count"
pytestmark = pytest.mark.skipif(has_gpu(), reason="a machine without a GPU is the case here")


def _env(**extra) -> dict:
    """This machine's environment as a user has it: no device count set (the suite's other XLA flags kept)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "JAX_NUM_CPU_DEVICES")}
    return dict(env, XLA_FLAGS=" ".join(flags), PYTHONPATH=str(ROOT), **extra)


def _run(args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600, **kw)


def test_version_and_help_are_quiet_and_help_loads_no_jax():
    out = _run(["-m", "jaxmem.cli", "--version"])
    assert out.returncode == 0 and out.stdout.startswith("jaxmem ") and out.stderr == ""
    code = "import sys; from jaxmem import cli; cli.main(['--help']); assert 'jax' not in sys.modules, 'jax'"
    out = _run(["-c", code])
    assert out.returncode == 0 and "commands:" in out.stdout, out.stderr


@pytest.mark.slow
def test_the_readme_example_runs_on_a_cpu_machine_one_line_per_step(tmp_path):
    out = _run(["-m", "jaxmem.cli", "train", "configs/tiny.yaml", f"out_dir={tmp_path}", "train.steps=3",
                "train.log_every=1", "parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "on 8 cpu devices" in out.stderr + out.stdout  # the CLI set XLA's device count to the mesh's
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all(line.endswith("s/step") for line in steps), out.stdout  # not wrapped
    assert "━" not in out.stdout  # no progress bar in a pipe
    assert "cuda" not in out.stderr.lower() and "absl" not in out.stderr, out.stderr


def test_a_mesh_the_set_device_count_cannot_hold_names_the_flag(tmp_path):
    env = _env()
    env["XLA_FLAGS"] += f" {COUNT_FLAG}=2"
    out = subprocess.run([sys.executable, "-m", "jaxmem.cli", "train", "configs/tiny.yaml", f"out_dir={tmp_path}",
                          "parallel.fsdp=4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"jaxmem train: config error: parallel: the mesh takes 4 CPU devices but XLA_FLAGS asks for 2; set "
        f"XLA_FLAGS={COUNT_FLAG}=4 (or unset it: jaxmem then sets it)")


def test_load_hf_from_python_prints_nothing_on_stderr(tmp_path):
    model = resolve_model(ModelConfig(preset="tiny"), {})
    save_hf(init_model(model, seed=0), tmp_path)
    env = {k: v for k, v in _env().items() if k != "JAX_PLATFORMS"}  # as a user starts Python
    out = subprocess.run([sys.executable, "-c", f"import jaxmem; print(jaxmem.load_hf({str(tmp_path)!r}).cfg.d_model)"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "128" and out.stderr == "", out.stderr
