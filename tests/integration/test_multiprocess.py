"""Multi-process training: 2 local processes x 4 CPU devices (gloo) match 1 process x 8 devices."""
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cpu_env import cpu_env

from jaxmem.config import ConfigError, DistributedConfig
from jaxmem.runtime.distributed import init_settings
from jaxmem.train.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_init_settings_explicit_coordinator():
    cfg = DistributedConfig(coordinator="10.0.0.1:1234", num_processes=4, process_id=3)
    assert init_settings(cfg, {}) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}


@pytest.mark.parametrize("cfg, key", [
    (DistributedConfig(coordinator="h:1", num_processes=2, process_id=2), "distributed.process_id"),
    (DistributedConfig(coordinator="h:1", num_processes=0, process_id=0), "distributed.num_processes"),
    (DistributedConfig(coordinator="host", num_processes=2, process_id=0), "distributed.coordinator"),
    (DistributedConfig(num_processes=2, process_id=0), "distributed.coordinator"),
])
def test_init_settings_rejects_incomplete_settings_by_name(cfg, key):
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        init_settings(cfg, {})


def test_init_settings_detect_slurm_only_when_it_is_there():
    slurm = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "1", "SLURM_NTASKS": "16"}
    assert init_settings(DistributedConfig(), slurm) == {}  # jax reads the SLURM variables itself
    assert init_settings(DistributedConfig(auto=False), slurm) is None
    assert init_settings(DistributedConfig(), dict(slurm, SLURM_NTASKS="1")) is None
    assert init_settings(DistributedConfig(), {}) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(out_dir: Path, devices: int, extra: list[str]) -> subprocess.Popen:
    env = cpu_env(devices)
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", "configs/tiny.yaml", f"out_dir={out_dir}",
           f"train.steps={STEPS}", "train.log_every=1", "train.progress=false", "train.seq_len=32", *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen]) -> None:
    try:
        outputs = [p.communicate(timeout=480)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    port = _free_port()
    multi = tmp_path / "multi"
    _wait([_train(multi, 4, [f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                             f"distributed.process_id={i}"]) for i in range(2)])
    _wait([_train(tmp_path / "single", 8, [])])
    got = read_jsonl(multi / "metrics.jsonl")  # written by process 0 only
    want = read_jsonl(tmp_path / "single" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=1e-5)
    assert (multi / "checkpoints" / str(STEPS)).is_dir()  # both processes took part in the save


@pytest.mark.slow
def test_pipeline_across_two_processes_matches_one_and_its_checkpoints_resume(tmp_path):
    """pp=2 with one stage per process (its activations cross processes) trains like pp=2 in one process;
    each process writes its stage into the checkpoint, which resumes across two processes and in one
    process without a pipeline, continuing the straight run's losses."""
    pipeline = ["parallel.pp=2", "train.grad_accum=2", f"optimizer.decay_steps={STEPS + 2}"]  # one LR schedule
    more = [f"train.steps={STEPS + 2}"]

    def two(out_dir: Path, extra: list[str]) -> None:
        port = _free_port()
        _wait([_train(out_dir, 4, pipeline + extra + [f"distributed.coordinator=127.0.0.1:{port}",
                                                      "distributed.num_processes=2", f"distributed.process_id={i}"])
               for i in range(2)])

    multi, flat = tmp_path / "multi", tmp_path / "flat"
    two(multi, [])
    saved = multi / "checkpoints" / str(STEPS) / "stages"
    assert sorted(p.name for p in saved.glob("stage_*")) == ["stage_0", "stage_1"]  # one per process
    shutil.copytree(multi, flat)
    _wait([_train(tmp_path / "single", 8, pipeline + more + ["checkpoint.enabled=false"])])
    want = read_jsonl(tmp_path / "single" / "metrics.jsonl")
    got = read_jsonl(multi / "metrics.jsonl")  # written by process 0 only
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want[:STEPS]], rtol=1e-6)
    np.testing.assert_allclose([r["grad_norm"] for r in got], [r["grad_norm"] for r in want[:STEPS]], rtol=1e-5)

    two(multi, more)
    _wait([_train(flat, 8, more + pipeline[2:])])  # no pipeline: the stages are re-cut into one model
    for out_dir in (multi, flat):
        resumed = [r for r in read_jsonl(out_dir / "metrics.jsonl") if r["step"] > STEPS]
        assert [r["step"] for r in resumed] == [STEPS + 1, STEPS + 2]
        np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in want[STEPS:]], rtol=2e-5)


@pytest.mark.slow
def test_a_grpo_run_across_two_processes_matches_one(tmp_path):
    """GRPO on two processes (the rollout's rows placed from every process, its completions and log-probs
    gathered whole on each host, the rewards scored on each): the same completions, rewards and losses as one
    process over the same 8 devices (configs/rl/tiny-grpo.yaml on scripts/rl_example.py's files, KL on)."""
    example = tmp_path / "rl_example"
    done = subprocess.run([sys.executable, "scripts/rl_example.py", str(example)], cwd=REPO, env=cpu_env(1),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    files = [f"checkpoint.init_from={example / 'hf'}", f"data.tokenizer={example / 'hf' / 'tokenizer.json'}",
             f"rl.prompts={example / 'prompts.jsonl'}", "parallel.fsdp=8", "train.micro_batch=4", "rl.beta=0.04",
             "rl.samples_every=1", "checkpoint.enabled=false"]

    def grpo(out_dir: Path, devices: int, extra: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "jaxmem.cli", "train", "configs/rl/tiny-grpo.yaml", f"out_dir={out_dir}",
               f"train.steps={STEPS}", "train.log_every=1", "train.progress=false", *files, *extra]
        return subprocess.Popen(cmd, cwd=REPO, env=cpu_env(devices), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    port = _free_port()
    _wait([grpo(tmp_path / "multi", 4, [f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                                        f"distributed.process_id={i}"]) for i in range(2)]
          + [grpo(tmp_path / "single", 8, [])])
    got, want = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("multi", "single"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "reward", "kl"):
        np.testing.assert_allclose([r[key] for r in got], [r[key] for r in want], rtol=1e-5, atol=1e-7, err_msg=key)
    assert (tmp_path / "multi" / "samples.jsonl").read_text() == (tmp_path / "single" / "samples.jsonl").read_text()
