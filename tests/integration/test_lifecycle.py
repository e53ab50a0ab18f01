"""A run loses nothing: SIGTERM and Ctrl-C save the current step and the resume continues exactly; one run per
out_dir (a live owner refuses a second run, a dead one's lock is taken over); a peer killed with -9 ends the
survivor within 30 s in one line, and both resume; the small one-line errors."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cpu_env import cpu_env

from jaxmem.core.checkpoint import Checkpoints
from jaxmem.config import ConfigError
from jaxmem.loader import load_config
from jaxmem.train.metrics import read_jsonl
from jaxmem.registry import build_program
from jaxmem.train.run_lock import LOCK_NAME, RunLock, RunLockError
from jaxmem.train.signals import EXIT_LOCKED, EXIT_PEER_LOST, EXIT_SAVED
from jaxmem.train import run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
STEPS = 10
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "train.progress=false", "train.seq_len=32",
          "checkpoint.every=0", "checkpoint.keep=5"]


def _start(out_dir, *extra, sleep="0.4", devices=8):
    env = cpu_env(devices, JAXMEM_TEST_STEP_SLEEP=sleep)
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", str(TINY), f"out_dir={out_dir}", *COMMON, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, what, proc=None, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _logged(out_dir) -> list[int]:
    path = Path(out_dir) / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)] if path.exists() else []


def _params(out_dir, step, *overrides):
    cfg = load_config(TINY, [f"out_dir={out_dir}", *COMMON, *overrides])
    prog = build_program(cfg)
    ckpts = Checkpoints.for_run(cfg)
    state, _ = ckpts.restore(prog.abstract_state, step)
    ckpts.close()
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state["params"]))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run: its records and its final checkpoint."""
    out = tmp_path_factory.mktemp("straight")
    summary = run(load_config(TINY, [f"out_dir={out}", *COMMON]))
    assert summary["checkpoint_steps"] == [STEPS] and summary["stopped_by"] is None
    return out, {r["step"]: r["loss"] for r in summary["records"]}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_current_step_and_the_resume_continues_exactly(straight, tmp_path, sig):
    out = tmp_path / "run"
    proc = _start(out)
    try:
        _wait_for(lambda: len(_logged(out)) >= 3, "step 3", proc)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SAVED, err[-3000:]
    saved = Checkpoints(out / "checkpoints").all_steps()
    assert len(saved) == 1 and 3 <= saved[0] < STEPS  # checkpoint.every=0: only the signal saved
    step = saved[0]
    name = signal.Signals(sig).name
    assert err.strip().splitlines()[-1] == (f"jaxmem train: {name}: saved step {step} to {out / 'checkpoints'}; "
                                            "rerun the same command to resume")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert _logged(out) == list(range(1, step + 1))  # every step up to the saved one was flushed
    assert not (out / LOCK_NAME).exists()

    resumed = run(load_config(TINY, [f"out_dir={out}", *COMMON]))
    assert resumed["resumed_from"] == step and resumed["final_step"] == STEPS
    want_dir, want = straight
    assert {r["step"]: r["loss"] for r in resumed["records"]} == {s: want[s] for s in range(step + 1, STEPS + 1)}
    for mine, theirs in zip(_params(out, STEPS), _params(want_dir, STEPS), strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    out = tmp_path / "run"
    proc = _start(out, sleep="1.5")
    try:
        _wait_for(lambda: len(_logged(out)) >= 1, "step 1", proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "second Ctrl-C: stopped at once" in err and "Traceback" not in err
    assert not (out / LOCK_NAME).exists()
    assert not (out / "checkpoints").exists() or Checkpoints(out / "checkpoints").all_steps() == []


@pytest.mark.slow
def test_a_second_run_on_a_live_out_dir_is_refused_and_the_first_finishes(tmp_path):
    out = tmp_path / "run"
    first = _start(out, "checkpoint.every=4", sleep="0.3")
    try:
        _wait_for(lambda: len(_logged(out)) >= 1, "the first run's step 1", first)
        owner = json.loads((out / LOCK_NAME).read_text())
        assert owner["pid"] == first.pid and owner["host"] == socket.gethostname()
        second = _start(out, sleep="0")
        _, err2 = second.communicate(timeout=120)
        _, err1 = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == EXIT_LOCKED
    lines = [line for line in err2.strip().splitlines() if line.startswith("jaxmem")]
    assert lines[-1].startswith(f"jaxmem train: out_dir {out} is in use by another run: pid {first.pid} on host")
    assert len([line for line in err2.splitlines() if "in use" in line]) == 1 and "Traceback" not in err2
    assert first.returncode == 0, err1[-3000:]
    assert _logged(out) == list(range(1, STEPS + 1))  # no duplicate records
    assert not (out / LOCK_NAME).exists()


def test_a_stale_lock_is_taken_over_and_a_foreign_host_lock_refuses(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.0}))
    summary = run(load_config(TINY, [f"out_dir={out}", *COMMON[1:], "train.steps=2"]))
    assert summary["final_step"] == 2
    err = capsys.readouterr().err
    assert f"taking over the lock {out / LOCK_NAME}: pid {dead.pid} on host {socket.gethostname()}" in err
    assert not (out / LOCK_NAME).exists()  # released at the end

    (out / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": os.getpid(), "started": 1.0}))
    with pytest.raises(RunLockError, match=rf"in use by another run: pid {os.getpid()} on host elsewhere .*; if "
                                           rf"that run is gone, delete {out / LOCK_NAME}$"):
        RunLock(out).acquire()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(out, *extra, sleep):
    port = _free_port()
    return [_start(out, "checkpoint.every=2", f"distributed.coordinator=127.0.0.1:{port}",
                   "distributed.num_processes=2", f"distributed.process_id={i}", *extra, sleep=sleep, devices=4)
            for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("killed", [1, 0])  # process 0 also hosts jax's coordination service
def test_a_killed_peer_ends_the_survivor_in_one_line_and_both_resume(tmp_path, killed):
    out = tmp_path / "run"
    procs = _pair(out, sleep="0.5")
    survivor = procs[1 - killed]
    try:
        _wait_for(lambda: (out / "checkpoints" / "4").is_dir(), "the step-4 checkpoint", procs[0])
        procs[killed].send_signal(signal.SIGKILL)
        killed_at = time.time()
        _, err = survivor.communicate(timeout=60)
        took = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    # process 1 lost: the peer watch ends process 0 (exit 76); process 0 lost: jax aborts process 1 from C++ (its
    # coordination service is gone) and jaxmem.runtime.stderr_guard replaces the trace by the line
    assert survivor.returncode == (EXIT_PEER_LOST if killed else -signal.SIGABRT), err[-3000:]
    assert took < 30, took
    last = Checkpoints(out / "checkpoints").latest_step()
    assert last is not None and last >= 4
    tail = err.strip().splitlines()[-1]
    why = "(no heartbeat for" if killed else "(the coordinator: its service stopped answering)"
    assert tail.startswith(f"jaxmem train: lost process {killed} {why}"), err[-3000:]
    assert f"the last saved checkpoint is step {last} in {out / 'checkpoints'}" in tail
    assert "Check failed" not in err and "Traceback" not in err and "*** " not in err
    assert (out / LOCK_NAME).exists() == (killed == 0)  # process 0 holds it: killed (stale lock) or released it

    procs = _pair(out, sleep="0")
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, e) in zip(procs, outputs):
        assert p.returncode == 0, e[-3000:]
    assert f"resuming at step {last}" in outputs[0][1]
    assert Checkpoints(out / "checkpoints").latest_step() == STEPS


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path):
    """jax's preemption sync: the notice reaches the other process and both save (one orbax save spans both)."""
    out = tmp_path / "run"
    procs = _pair(out, "checkpoint.every=0", sleep="0.5")
    try:
        _wait_for(lambda: len(_logged(out)) >= 2, "step 2", procs[0])
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, e) in zip(procs, outputs):
        assert p.returncode == EXIT_SAVED, e[-3000:]
    saved = Checkpoints(out / "checkpoints").all_steps()
    assert len(saved) == 1 and 2 <= saved[0] < STEPS
    assert outputs[0][1].strip().splitlines()[-1] == (f"jaxmem train: SIGTERM: saved step {saved[0]} to "
                                                      f"{out / 'checkpoints'}; rerun the same command to resume")
    assert _logged(out) == list(range(1, saved[0] + 1))


@pytest.mark.slow
def test_a_two_process_run_on_a_live_out_dir_is_refused_on_both(tmp_path):
    """One lock, on process 0; process 1 learns the refusal through the coordination service and stops too."""
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": 1.0}))
    procs = _pair(out, sleep="0")
    outputs = [p.communicate(timeout=180) for p in procs]
    for p, (_, e) in zip(procs, outputs):
        assert p.returncode == EXIT_LOCKED, e[-3000:]
        assert e.strip().splitlines()[-1].startswith(f"jaxmem train: out_dir {out} is in use by another run: "
                                                     f"pid {os.getpid()} on host")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written, the owner's lock kept


def test_an_empty_override_value_is_a_one_line_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"^train\.wandb: empty value in the override 'train\.wandb='"):
        load_config(TINY, ["train.wandb="])
    assert load_config(TINY, ["train.wandb=''"]).train.wandb == ""


def test_null_chat_content_is_a_one_line_error(tmp_path):
    from jaxmem.io.documents.tokenize import payloads

    data = load_config(TINY, ["data.format=messages", "data.kind=jsonl", "data.path=f.jsonl",
                              "data.tokenizer=tok.json"]).data
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}
    with pytest.raises(ConfigError, match=r"^data\.messages_field: record 1 \(f\.jsonl:1\) turn 1 \(assistant\) "
                                          r"has content null; give a string"):
        payloads(data, [(record, "f.jsonl:1")])


def test_every_minutes_saves_by_time_and_is_checked(tmp_path, capsys):
    summary = run(load_config(TINY, [f"out_dir={tmp_path}", *COMMON[1:], "train.steps=3",
                                     "checkpoint.every_minutes=1e-9"]))  # due after every step
    assert summary["checkpoint_steps"] == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"^checkpoint\.every_minutes: must be a number >= 0"):
        load_config(TINY, ["checkpoint.every_minutes=-1"])
    err = capsys.readouterr()
    assert "trained tok/s (" in err.out and " seen)" in err.out  # both token rates, labeled


def test_the_cli_switches_off_the_cpu_concurrency_scheduler_unless_told(monkeypatch):
    from jaxmem import cli

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    cli._cpu_scheduler_flag()
    assert os.environ["XLA_FLAGS"] == ("--xla_force_host_platform_device_count=8 "
                                       "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    cli._cpu_scheduler_flag()  # the user's own setting wins
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_concurrency_optimized_scheduler=true"


def test_a_missing_jinja2_names_the_data_extra(monkeypatch):
    from jaxmem.io.documents.chat import ChatTemplate

    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.exceptions", None)
    with pytest.raises(ConfigError, match=r"^data\.chat_template: x\.jinja: chat templates need the jinja2 package; "
                                          r"pip install 'jaxmem\[data\]'"):
        ChatTemplate("{{ messages }}", "data.chat_template: x.jinja")
