"""The train loop as a library: `run(cfg)` trains a config, resuming from its out_dir's latest checkpoint.

A run writes to `out_dir`: `config.resolved.yaml` (the resolved config), `metrics.jsonl` (one JSON object per
logged step: step, loss, grad_norm, lr, tokens_per_sec, step_time_s, tokens; on backends that report allocator
stats also mem/* and plan/* device-memory figures, see jaxmem.train.telemetry) and `checkpoints/`. Times and
tokens/s are wall-clock figures measured on the host the run ran on (over the steps since the previous record),
on whatever devices it had: CPU figures say nothing about a GPU.

For scripts, the pieces used here are importable: `jaxmem.loader.load_config`, `jaxmem.core.program.build_program`,
`jaxmem.io.data.batches`, `jaxmem.core.checkpoint.Checkpoints` and `jaxmem.train.resume` (see
scripts/train_example.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import jax
import yaml

from jaxmem.runtime import distributed
from jaxmem.train import peer_watch, run_lock
from jaxmem.train.run_folder import RESOLVED_CONFIG, changed_identity, check_checkpointless_run
from jaxmem.core.checkpoint import (RUN_META_KEYS, Checkpoints, SaveFailed, init_from, math_hash, restore_intact,
                                    run_meta)
from jaxmem.config.schema import Config, to_dict
from jaxmem.io.no_follow import write_text
from jaxmem.io.data import Batches, TokenSource, make_source
from jaxmem.io.console import is_terminal
from jaxmem.train.evaluate import Evaluator
from jaxmem.train.metrics import (JsonlWriter, ProgressBar, TensorBoardWriter, WandbWriter, log_line,
                                  summary_writer_class, wandb_available)
from jaxmem.optim.hyper import schedule_steps
from jaxmem.plan.oom import is_oom
from jaxmem.core.precision import all_finite
from jaxmem.core.program import TrainProgram
from jaxmem.registry import build_run_program, for_config
from jaxmem.train.save_clock import SaveClock
from jaxmem.train.signals import StopRequest
from jaxmem.train.telemetry import MemoryTelemetry, save_memory_profile

# Fault-injection hook for the kill-and-resume tests: seconds to wait before each step (0: none).
_STEP_SLEEP_S = float(os.environ.get("JAXMEM_TEST_STEP_SLEEP", "0") or 0)


class TrainError(RuntimeError):
    """A run stopped for a reason the user must act on; the message is short and says what to do."""


class SaveError(TrainError):
    """A checkpoint could not be written (a full disk, a read-only folder, an I/O error): the run stopped after
    the step in flight; orbax may still hold threads waiting on the failed save, so a command line exits at once
    (jaxmem.train.signals.exit_now) rather than wait for them."""


def initial_state(prog: TrainProgram, ckpts: Checkpoints | None) -> tuple[dict, int, int | None, int | None]:
    """(state, start step, data position, resumed-from step): latest checkpoint, else init_from, else fresh."""
    cfg = prog.cfg
    latest = ckpts.latest_step() if ckpts else None
    if latest is not None:
        # damaged (unless checkpoint.on_corrupt=previous finds an intact one) or another model's: one line
        state, meta, latest = restore_intact(prog, ckpts, cfg.checkpoint.on_corrupt, _note, RUN_META_KEYS)
        rows = prog.grad_accum * prog.rows
        if meta.get("config_hash") != math_hash(cfg) or meta.get("batch_rows") != rows:
            _note(_resume_mismatch(cfg, meta, latest, rows))
        return state, int(meta["step"]), int(meta["data_position"]), latest
    if cfg.checkpoint.init_from:
        state = init_from(prog, cfg.checkpoint.init_from)
        count = sum(math.prod(x.shape) for x in jax.tree.leaves(prog.abstract_model_params()))
        _note(f"loaded checkpoint.init_from {Path(cfg.checkpoint.init_from).absolute()}: {count:,} model "
              "parameters (params only: the optimizer starts fresh at step 0)")
        return state, 0, None, None
    return prog.init_state(), 0, None, None


def _saved_decay(meta: dict) -> int | None:
    decay = meta.get("decay_steps")
    return decay if type(decay) is int and decay > 0 else None


def _with_decay(cfg: Config, decay: int) -> Config:
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, decay_steps=decay))


def resume_schedule(cfg: Config, ckpts: Checkpoints | None) -> Config:
    """cfg with the LR schedule of the checkpoint a resume starts from; call it before `build_program`.

    optimizer.decay_steps=0 means train.steps, so raising train.steps on resume would stretch the
    cosine decay and jump the LR. If cfg leaves decay_steps at 0 and the latest checkpoint's meta holds
    the decay length it was saved with, that length is set here (program, optimizer and metrics share
    it). An explicit non-zero optimizer.decay_steps wins (`initial_state` notes the difference); a
    checkpoint saved before the length was recorded changes nothing.
    """
    meta = ckpts.newest_meta(cfg.checkpoint.on_corrupt) if ckpts else None
    saved = _saved_decay(meta) if meta else None
    if saved is None or cfg.optimizer.decay_steps:
        return cfg
    if saved != cfg.train.steps:
        _note(f"keeping the saved LR schedule (decay over {saved} steps, not train.steps={cfg.train.steps}); "
              f"set optimizer.decay_steps={cfg.train.steps} to decay over train.steps instead")
    return _with_decay(cfg, saved)


def _resume_mismatch(cfg: Config, meta: dict, step: int, rows: int) -> str:
    """The note for a resume whose settings differ from the checkpoint's; it names the key that keeps the LR."""
    decay = schedule_steps(cfg)[1]
    saved = _saved_decay(meta)
    if saved is None and "decay_steps" not in meta and math_hash(_with_decay(cfg, step)) == meta.get("config_hash"):
        saved = step  # saved before the length was recorded, by a run that decayed over the steps it ran
    if saved is not None and saved != decay and meta.get("batch_rows") == rows \
            and math_hash(_with_decay(cfg, saved)) == meta.get("config_hash"):
        return (f"resuming step {step} with the LR decaying over {decay} steps, the saved run's over {saved}; "
                f"set optimizer.decay_steps={saved} to keep the saved schedule")
    text = (f"resuming step {step} saved with other model/optimizer/data/batch settings; "
            "losses will not continue the saved run's curve exactly")
    if saved is not None and saved != decay:
        return text + f"; set optimizer.decay_steps={saved} to keep the saved LR schedule"
    if saved is None and not cfg.optimizer.decay_steps:
        return text + ("; if train.steps changed, set optimizer.decay_steps to the saved run's train.steps "
                       "to keep its LR schedule")
    return text


def _note(text: str) -> None:
    if jax.process_index() == 0:
        print(f"jaxmem train: {text}", file=sys.stderr)


def _oom_error(when: str, e: Exception) -> TrainError:
    first = str(e).strip().splitlines()[0][:200]
    return TrainError(f"out of device memory while {when} the train step ({first}); run `jaxmem explain CONFIG` "
                      "with the same overrides to see which buffers fill the memory")


def compile_train_step(prog: TrainProgram):
    """The program's train step (jaxmem.core.plugins.RunProgram.compile_step: compiled ahead of time for its
    shardings, or per stage at the first call); OOM becomes a TrainError."""
    try:
        return prog.compile_step()
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            raise _oom_error("compiling", e) from None
        raise


def _state_finite(prog: TrainProgram, state: dict) -> bool:
    weights = [{k: part[k] for k in ("params", "master") if k in part} for part in prog.state_item.parts(state)]
    return all(bool(jax.jit(all_finite)(w)) for w in weights)  # one jit per program's devices


class _Outputs:
    """metrics.jsonl, TensorBoard, progress bar and plain log lines (process 0 only)."""

    def __init__(self, cfg: Config, start: int):
        self.lead = jax.process_index() == 0
        self.plain = not (cfg.train.progress and is_terminal())  # a pipe or a file: one plain line per record
        self.writers = []
        if self.lead:
            out = Path(cfg.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            if cfg.train.tensorboard:
                self.writers.append(TensorBoardWriter(out / "tensorboard", start))
            if cfg.train.wandb:
                self.writers.append(WandbWriter(cfg.train.wandb, out, to_dict(cfg)))
            jsonl = JsonlWriter(out / "metrics.jsonl", start)
            if jsonl.cut:
                _note(jsonl.cut)
            self.writers.append(jsonl)
        self.bar = ProgressBar(cfg.train.steps, start, enabled=self.lead and not self.plain)

    def write_config(self, cfg: Config) -> None:
        """config.resolved.yaml, written when a step is about to be trained (never through a link): a rerun that
        trains nothing leaves the run's own as it is."""
        if self.lead:
            write_text(Path(cfg.out_dir) / RESOLVED_CONFIG, yaml.safe_dump(to_dict(cfg), sort_keys=False))

    def record(self, record: dict) -> None:
        if not self.lead:
            return
        for w in self.writers:
            w.write(record)
        self.bar.show(record)
        if self.plain:
            print(log_line(record), flush=True)

    def close(self) -> None:
        self.bar.close()
        for w in self.writers:
            w.close()


# Loops of objectives that are not a pass over a token source, by train.objective; each module registers its
# own (jaxmem.train.rl_loop: grpo), imported by the package jaxmem.train.
OBJECTIVE_LOOPS: dict = {}


def run(cfg: Config) -> dict:
    """Trains `cfg` (resuming from `<out_dir>/checkpoints` if it holds one); returns a summary dict.

    The summary has `records` (the metrics.jsonl records of this invocation),
    `start_step`, `final_step`, `resumed_from`, `compile_time_s`, `checkpoint_steps`,
    `memory_warnings` (name -> text; device-memory telemetry, see jaxmem.train.telemetry) and `stopped_by`
    (the signal that ended the run early after saving `final_step`, else None).
    SIGTERM and a first Ctrl-C end the run after the current step with a checkpoint of it (jaxmem.train.signals);
    out_dir is locked for the run (jaxmem.train.run_lock: RunLockError if another live run holds it).
    """
    distributed.initialize(cfg.distributed)  # before anything asks JAX for devices
    peer_watch.start_for_run(cfg)  # a dead peer ends this process within seconds, in one line
    multi = distributed.process_group()[1] > 1
    try:  # the lock before anything is written into out_dir; the handlers before the data and the compile
        with run_lock.owned(cfg.out_dir), StopRequest(multi_process=multi) as stop:
            return _run_locked(cfg, stop)
    finally:
        peer_watch.finish_run()


def _run_locked(cfg: Config, stop: StopRequest) -> dict:
    if cfg.train.tensorboard:
        summary_writer_class()  # a missing writer fails now, not after the compile
    if cfg.train.wandb:
        wandb_available()
    if not cfg.checkpoint.enabled:
        check_checkpointless_run(cfg.out_dir)  # it would start at step 0 over a saved run's metrics
    grpo = cfg.train.objective == "grpo"  # prompts and rollouts instead of a token source (jaxmem.train.rl_loop)
    source = None if grpo else make_source(cfg)  # a text file is read and checked against the vocabulary here
    ckpts = Checkpoints.for_run(cfg) if cfg.checkpoint.enabled else None
    try:
        cfg = resume_schedule(cfg, ckpts)  # a resume keeps the saved LR schedule when train.steps grows
        prog = build_run_program(cfg)
        if grpo:
            return OBJECTIVE_LOOPS["grpo"](cfg, prog, ckpts, stop)
        return _train(cfg, prog, ckpts, source, Evaluator.for_run(cfg, prog), stop)
    finally:
        if ckpts:
            ckpts.close()  # finishes saves already started; the state that failed is never among them


def _train(cfg: Config, prog: TrainProgram, ckpts: Checkpoints | None, source: TokenSource,
           evaluator: Evaluator | None = None, stop: StopRequest | None = None) -> dict:
    total, every = cfg.train.steps, cfg.checkpoint.every
    state, start, position, resumed = initial_state(prog, ckpts)
    summary = {"out_dir": str(cfg.out_dir), "start_step": start, "final_step": start, "resumed_from": resumed,
               "records": [], "compile_time_s": None, "checkpoint_steps": [], "memory_warnings": {},
               "stopped_by": None}
    outputs = _Outputs(cfg, start)
    stop = stop or StopRequest(multi_process=jax.process_count() > 1)  # (no handlers: never stops early)
    try:
        if start >= total:
            _finished(cfg, start)
            return summary
        # a feature's pass over the data before training (stored reference log-probs: jaxmem.preference)
        source = for_config(cfg).prepare_source(cfg, prog, state, source, resumed is not None)
        data = Batches(source, prog, start, position)
        batch = next(data)  # bad data fails here, before the compile
        t0 = time.perf_counter()
        step_fn = compile_train_step(prog)
        summary["compile_time_s"] = time.perf_counter() - t0
        memory = MemoryTelemetry.for_compiled(step_fn)
        summary["memory_warnings"] = memory.warnings  # filled as warnings are raised
        _note(f"{'resuming at' if resumed is not None else 'starting at'} step {start} of {total} on "
              f"{jax.device_count()} {jax.devices()[0].platform} devices; times are measured on this host")
        _note(parameter_counts(prog))
        outputs.write_config(cfg)
        pending, last_sync, last_saved = [], time.perf_counter(), resumed
        clock = SaveClock(cfg.checkpoint.every_minutes if ckpts is not None else 0)
        seen_per_step = data.per_step * cfg.train.seq_len  # batch positions fed per step, trained or not
        for done in range(start + 1, total + 1):
            _check_saves(ckpts)  # a save started earlier failed: stop before the next step
            if _STEP_SLEEP_S:
                time.sleep(_STEP_SLEEP_S)
            state, metrics = step_fn(state, batch)
            pending.append((done, metrics))
            stopping = stop.due(done)  # the same step on every process
            if done < total and not stopping:
                batch = next(data)  # built on the host while the devices run the step
            outputs.bar.advance(done)
            if done == cfg.train.memory_profile_at:
                jax.block_until_ready(state)  # the profile shows the buffers live after the step
                save_memory_profile(cfg.out_dir, done)
            eval_now = evaluator is not None and evaluator.due(done, total) and not stopping
            log_now = (done % cfg.train.log_every == 0 or done == total or done == start + 1 or eval_now
                       or stopping)
            timed = clock.due(check=log_now)  # multi-process: process 0's clock, at log steps
            save_now = ckpts is not None and ((every and done % every == 0) or done == total or stopping or timed)
            if not (save_now or log_now):
                continue
            host = jax.device_get([m for _, m in pending])  # waits for the steps; surfaces NaN and OOM
            now = time.perf_counter()
            _check_finite(cfg, pending, host, ckpts)
            if log_now:
                record = _record(done, host, now - last_sync, cfg.precision.loss_scale.enabled, seen_per_step)
                record.update(memory.sample())  # between steps: the devices have finished `done`
                if eval_now:
                    record.update(evaluator.run(state))
                summary["records"].append(record)
                outputs.record(record)
            pending, last_sync = [], now
            if save_now and done != last_saved:
                _save(cfg, prog, ckpts, state, done, data, last_saved)
                clock.saved()
                last_saved = done
            if stopping:
                summary["stopped_by"] = stop.signal
                break
        summary["final_step"] = done
        if ckpts:
            _wait_saves(ckpts)
            summary["checkpoint_steps"] = ckpts.all_steps()
        return summary
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            raise _oom_error("running", e) from None
        raise
    finally:
        outputs.close()


def _save(cfg: Config, prog: TrainProgram, ckpts: Checkpoints, state: dict, done: int, data: Batches,
          last_saved: int | None) -> None:
    """Starts the save of step `done`: never of non-finite weights, never onto a disk without room for it (a
    TrainError in one line either way; the checkpoints saved before are left as they are)."""
    if not _state_finite(prog, state):
        raise TrainError(f"step {done}: the weights hold inf/NaN; not saved ({_last_good(last_saved)}); "
                         "lower optimizer.lr")
    try:
        ckpts.room_for(state, done)
        meta = dict(run_meta(cfg, done, data.position_at(done), data.per_step), **prog.checkpoint_meta())
        ckpts.save(done, state, meta, prog.state_item)
    except SaveFailed as e:
        raise SaveError(str(e)) from None


def _last_good(step: int | None) -> str:
    return f"last good checkpoint: step {step}" if step is not None else "no checkpoint was saved before it"


def _finished(cfg: Config, start: int) -> None:
    """A rerun of a finished run trains nothing and writes nothing; with other model, data or LoRA keys it is
    refused, since the run's config.resolved.yaml (what export-hf ships) must keep describing what was trained."""
    changed = changed_identity(cfg.out_dir, to_dict(cfg))
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise TrainError(f"{cfg.out_dir} holds a run finished at step {start}, trained with other {shown} than "
                         "this config's; nothing was trained or written: rerun with the run's own settings, or use "
                         "a new out_dir")
    _note(f"{cfg.out_dir} already holds step {start} >= train.steps={cfg.train.steps}; nothing to train")


def _check_saves(ckpts: Checkpoints | None) -> None:
    """A SaveError in one line once a save started earlier has failed (a full disk, an I/O error)."""
    failed = ckpts.failure() if ckpts is not None else None
    if failed:
        raise SaveError(failed)


def _wait_saves(ckpts: Checkpoints) -> None:
    """Waits for the last saves; a SaveError in one line if one failed."""
    try:
        ckpts.wait()
    except SaveFailed as e:
        raise SaveError(str(e)) from None


def parameter_counts(prog: TrainProgram) -> str:
    """One line: trainable and frozen parameter counts (counted from the state's shapes)."""
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    trainable = count(prog.layout.abstract_params)
    if not prog.layout.freezes_model:
        return f"{trainable:,} trainable parameters (full fine-tune)"
    frozen = count(prog.layout.model_abstract_params)
    lo = prog.layout.part("lora")
    return (f"{trainable:,} trainable parameters (LoRA rank {lo.rank} adapters), {frozen:,} frozen "
            f"(base stored as {lo.base_dtype})")


def _check_finite(cfg: Config, pending: list, host: list, ckpts: Checkpoints | None) -> None:
    if cfg.precision.loss_scale.enabled:
        return  # fp16: overflowing steps are skipped by the loss scaler, not fatal
    for (step, _), m in zip(pending, host):
        if not (math.isfinite(float(m["loss"])) and math.isfinite(float(m["grad_norm"]))):
            if ckpts:
                _wait_saves(ckpts)  # saves of earlier, finite steps still count
            last = ckpts.latest_step() if ckpts else None
            kept = _last_good(last) if ckpts else "checkpoint.enabled=false: nothing was saved"
            raise TrainError(f"step {step}: loss is {float(m['loss'])} (grad_norm {float(m['grad_norm'])}); "
                             f"stopped without saving this state ({kept}); lower optimizer.lr or check the data")


ROUTER_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")  # jaxmem.model.moe.router_losses


def _record(step: int, host: list, elapsed: float, scaled: bool, seen_per_step: int) -> dict:
    """tokens_per_sec counts trained tokens (those the loss is taken over); seen_tokens_per_sec every batch
    position the model ran on (padding and untrained prompt tokens included)."""
    last = host[-1]
    tokens = sum(float(m["tokens"]) for m in host)
    record = {"step": step, "loss": float(last["loss"]), "grad_norm": float(last["grad_norm"]),
              "lr": float(last["lr"]), "tokens_per_sec": tokens / elapsed,
              "seen_tokens_per_sec": seen_per_step * len(host) / elapsed, "step_time_s": elapsed / len(host),
              "tokens": int(last["tokens"])}
    if scaled:
        record.update(loss_scale=float(last["loss_scale"]), update_skipped=bool(last["update_skipped"]))
    record.update({k: float(last[k]) for k in ROUTER_METRICS if k in last})  # a mixture of experts
    record.update({k: float(v) for k, v in last.items() if "/" in k})  # an objective's (core.plugins.Objective)
    return record
