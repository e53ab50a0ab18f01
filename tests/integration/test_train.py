"""`jaxmem train`: loss falls, outputs, exact resume, NaN stop, OOM message, CLI and TensorBoard."""
import dataclasses
import math
import shutil
import sys

import jax
import numpy as np
import pytest
import yaml

from jaxmem import cli
from jaxmem.core.checkpoint import Checkpoints
from jaxmem.config import ConfigError, to_dict
from jaxmem.loader import load_config
from jaxmem.train.metrics import REQUIRED_KEYS, read_jsonl
from jaxmem.optim.hyper import schedule
from jaxmem.core.precision import all_finite
from jaxmem.registry import build_program
from jaxmem.train import TrainError, compile_train_step, run

from tiny_config import TINY, tiny_config

_cfg = tiny_config


@pytest.mark.slow
def test_loss_falls_and_outputs_are_written(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=30", "train.log_every=1", "checkpoint.every=0", "train.seq_len=32")
    summary = run(cfg)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records == summary["records"] and [r["step"] for r in records] == list(range(1, 31))
    losses = [r["loss"] for r in records]
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert abs(losses[0] - math.log(256)) < 0.1  # starts at chance level over the 256-token vocabulary
    assert last < 0.5 * first, (first, last)
    lr_at = schedule(cfg)
    for r in records:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["tokens"] == 16 * 32  # 2 rows x 8 data ways x seq 32
        assert r["tokens_per_sec"] > 0 and r["step_time_s"] > 0 and math.isfinite(r["grad_norm"])
        assert r["lr"] == pytest.approx(float(lr_at(r["step"] - 1)), rel=1e-6)
    assert load_config(tmp_path / "config.resolved.yaml") == cfg
    assert yaml.safe_load((tmp_path / "config.resolved.yaml").read_text()) == to_dict(cfg)
    assert summary["checkpoint_steps"] == [30]  # every=0: only at the end


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=6", "train.log_every=1", "checkpoint.every=3", "train.seq_len=32")
    straight = run(cfg)
    assert straight["checkpoint_steps"] == [3, 6]
    # interrupted after step 3: the step-6 checkpoint never happened, a later one was half written
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    (tmp_path / "checkpoints" / "9.orbax-checkpoint-tmp-1700000000").mkdir()
    resumed = run(cfg)
    assert resumed["resumed_from"] == 3 and resumed["start_step"] == 3
    assert [r["step"] for r in resumed["records"]] == [4, 5, 6]
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"][3:]]
    assert [r["grad_norm"] for r in resumed["records"]] == [r["grad_norm"] for r in straight["records"][3:]]
    # the resume cut metrics.jsonl back to step 3 (the straight run's 4-6 were after the restored state)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    done = run(cfg)  # nothing left to train
    assert done["records"] == [] and done["start_step"] == done["final_step"] == 6


@pytest.mark.slow
def test_extending_a_run_keeps_its_lr_schedule_unless_decay_steps_is_set(tmp_path, capsys):
    args = ("train.log_every=1", "checkpoint.every=0", "train.seq_len=32", "checkpoint.async_save=false")
    run(_cfg(tmp_path / "a", "train.steps=4", *args))  # optimizer.decay_steps=0: decays over train.steps=4
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    capsys.readouterr()

    def lr(cfg, decay):
        lr_at = schedule(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, decay_steps=decay)))
        return [float(lr_at(step - 1)) for step in range(5, 9)]

    longer = _cfg(tmp_path / "a", "train.steps=8", *args)
    records = run(longer)["records"]
    assert [r["step"] for r in records] == [5, 6, 7, 8]
    assert [r["lr"] for r in records] == pytest.approx(lr(longer, 4), rel=1e-6)  # stays at the end of its decay
    assert lr(longer, 4) != pytest.approx(lr(longer, 8), rel=1e-3)  # what re-reading train.steps would give
    err = capsys.readouterr().err
    assert "keeping the saved LR schedule" in err and "set optimizer.decay_steps=8 " in err
    assert "other model/optimizer" not in err  # the math of the saved run continues
    assert Checkpoints.for_run(longer).meta()["decay_steps"] == 4  # and the next extension keeps it too

    explicit = _cfg(tmp_path / "b", "train.steps=8", "optimizer.decay_steps=6", *args)
    records = run(explicit)["records"]
    assert [r["lr"] for r in records] == pytest.approx(lr(explicit, 6), rel=1e-6)
    err = capsys.readouterr().err
    assert "set optimizer.decay_steps=4 to keep the saved schedule" in err and "keeping" not in err


def test_nan_loss_stops_before_the_bad_state_is_saved(tmp_path):
    cfg = _cfg(tmp_path, "train.steps=6", "train.log_every=1", "checkpoint.every=1", "optimizer.lr=1e30",
               "optimizer.warmup_steps=0", "checkpoint.async_save=false")
    with pytest.raises(TrainError, match=r"step (\d+): loss is .*stopped without saving") as info:
        run(cfg)
    bad = int(info.value.args[0].split()[1].rstrip(":"))
    steps = Checkpoints.for_run(cfg).all_steps()
    assert steps and max(steps) < bad
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["step"] < bad for r in records)
    prog = build_program(cfg)
    state, meta = Checkpoints.for_run(cfg).restore(prog.abstract_state)
    assert meta["step"] == max(steps) and bool(all_finite(state["params"]))


def test_out_of_memory_says_to_run_explain(tmp_path, monkeypatch):
    prog = build_program(_cfg(tmp_path))

    class _OomLowering:
        def lower(self, *args):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9.1GiB")

    monkeypatch.setattr(type(prog), "jit_step", lambda self: _OomLowering())
    with pytest.raises(TrainError, match=r"out of device memory while compiling .*jaxmem explain CONFIG"):
        compile_train_step(prog)


def test_cli_trains_and_writes_tensorboard(tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    rc = cli.main(["train", str(TINY), f"out_dir={tmp_path}", "train.steps=2", "train.log_every=1",
                   "train.progress=false", "train.tensorboard=true", "train.seq_len=32"])
    assert rc == 0
    assert "loss" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_without_a_writer_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"^train\.tensorboard: no TensorBoard writer"):
        run(_cfg(tmp_path, "train.tensorboard=true", "checkpoint.enabled=false"))


def test_cli_reports_bad_overrides_by_name(tmp_path, capsys):
    assert cli.main(["train", str(TINY), "train.stepz=3"]) == 2
    assert "train.stepz: unknown key" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resume_cuts_metrics_back_to_the_restored_step_and_drops_a_torn_line(tmp_path, capsys):
    """A crash after the last checkpoint leaves records of steps the state never kept, and may leave a line cut
    short; the resume removes both and says so in one line (the appended records then follow cleanly)."""
    cfg = _cfg(tmp_path, "train.steps=4", "train.log_every=1", "checkpoint.every=2", "train.seq_len=32")
    run(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "4")  # as if killed between the step-4 record and its checkpoint
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 1.0, "step_ti')  # torn by the kill
    capsys.readouterr()
    resumed = run(cfg)
    assert resumed["resumed_from"] == 2
    err = capsys.readouterr().err
    assert ("jaxmem train: metrics.jsonl: cut back to step 2, the state the run starts from (2 records after it "
            "and 1 torn line removed)") in err
    records = read_jsonl(tmp_path / "metrics.jsonl")  # every line parses: no record glued to a torn one
    assert [r["step"] for r in records] == [1, 2, 3, 4]
