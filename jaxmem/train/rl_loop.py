"""The GRPO loop (train.objective=grpo): a step is one rollout (jaxmem.rl.rollout: generation with the current
weights, rewards, advantages, the old and reference log-probs) then rl.updates_per_rollout optimizer steps on
it. The sampling key and the prompts of step s are functions of train.seed and s, so a resumed run continues
exactly as a straight one. Checkpoints, SIGINT / SIGTERM, metrics.jsonl and the finished-run rules are the
SFT loop's (jaxmem.train.loop); samples.jsonl gets a few completions every rl.samples_every steps."""
from __future__ import annotations

import json
import time
from pathlib import Path

import jax

from jaxmem.io.no_follow import open_no_follow
from jaxmem.rl.objective import METRICS
from jaxmem.rl.prompts import read_prompts, run_codec
from jaxmem.rl.rewards import RewardError, load_rewards
from jaxmem.rl.rollout import Rollouts, jit_train_step
from jaxmem.train import loop
from jaxmem.train.signals import StopRequest

SAMPLES_FILE = "samples.jsonl"
SAMPLES_PER_WRITE = 8  # completions written each time (the first prompts' groups)


class _Position:
    """What a checkpoint's meta records of the data: the rollout count (prompts are drawn per rollout)."""

    def __init__(self, per_step: int):
        self.per_step = per_step

    def position_at(self, step: int) -> int:
        return step * self.per_step


def train_grpo(cfg, prog, ckpts, stop: StopRequest) -> dict:
    codec = run_codec(cfg)
    rollouts = Rollouts(prog, codec, read_prompts(cfg, codec), load_rewards(cfg.rl.rewards, cfg.rl.reward_weights))
    state, start, _, resumed = loop.initial_state(prog, ckpts)
    summary = {"out_dir": str(cfg.out_dir), "start_step": start, "final_step": start, "resumed_from": resumed,
               "records": [], "compile_time_s": None, "checkpoint_steps": [], "memory_warnings": {},
               "stopped_by": None}
    if start >= cfg.train.steps:
        loop._finished(cfg, start)
        return summary
    outputs = loop._Outputs(cfg, start)
    _cut_samples(cfg, start)
    try:
        step_fn = jit_train_step(prog)
        loop._note(f"{'resuming at' if resumed is not None else 'starting at'} step {start} of {cfg.train.steps} "
                   f"(rollouts) on {jax.device_count()} {jax.devices()[0].platform} devices")
        outputs.write_config(cfg)
        summary["final_step"] = _steps(cfg, prog, ckpts, stop, rollouts, step_fn, state, start, resumed, outputs,
                                       summary)
        if ckpts:
            loop._wait_saves(ckpts)
            summary["checkpoint_steps"] = ckpts.all_steps()
        return summary
    finally:
        outputs.close()


def _steps(cfg, prog, ckpts, stop, rollouts, step_fn, state, start, resumed, outputs, summary) -> int:
    every, last_saved, data = cfg.checkpoint.every, resumed, _Position(rollouts.n)
    done = start
    for done in range(start + 1, cfg.train.steps + 1):
        loop._check_saves(ckpts)
        t0 = time.perf_counter()
        try:
            rollout = rollouts.collect(state, done - 1)
        except RewardError as e:
            if ckpts is not None and done - 1 > start and done - 1 != last_saved:
                loop._save(cfg, prog, ckpts, state, done - 1, data, last_saved)
                loop._wait_saves(ckpts)
            saved = f"saved step {done - 1}" if ckpts is not None and done - 1 > start else "nothing new to save"
            raise loop.TrainError(f"step {done}: {e}; {saved}") from None
        for _ in range(cfg.rl.updates_per_rollout):
            state, metrics = step_fn(state, rollout.batch)
        stopping = stop.due(done)
        if cfg.rl.samples_every and done % cfg.rl.samples_every == 0:
            _write_samples(cfg, done, rollout.samples)
        save_now = ckpts is not None and ((every and done % every == 0) or done == cfg.train.steps or stopping)
        if done % cfg.train.log_every == 0 or done == cfg.train.steps or done == start + 1 or stopping or save_now:
            host = jax.device_get(metrics)
            loop._check_finite(cfg, [(done, metrics)], [host], ckpts)
            record = loop._record(done, [host], time.perf_counter() - t0, cfg.precision.loss_scale.enabled,
                                  rollouts.n * cfg.train.seq_len)
            record.update({k: float(host[k]) for k in METRICS})  # "kl" too (the SFT record keeps names with "/")
            record.update(rollout.metrics)
            summary["records"].append(record)
            outputs.record(record)
        if save_now and done != last_saved:
            loop._save(cfg, prog, ckpts, state, done, data, last_saved)
            last_saved = done
        if stopping:
            summary["stopped_by"] = stop.signal
            break
    return done


loop.OBJECTIVE_LOOPS["grpo"] = train_grpo


def _cut_samples(cfg, start: int) -> None:
    """samples.jsonl keeps the steps up to the one resumed from: the steps after it are drawn again."""
    path = Path(cfg.out_dir) / SAMPLES_FILE
    if jax.process_index() != 0 or not path.is_file() or path.is_symlink():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines() if json.loads(line)["step"] <= start]
    with open_no_follow(path, "w") as f:
        f.write("".join(line + "\n" for line in kept))


def _write_samples(cfg, step: int, samples: list) -> None:
    if jax.process_index() != 0:
        return
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    with open_no_follow(Path(cfg.out_dir) / SAMPLES_FILE, "a") as f:
        for sample in samples[:SAMPLES_PER_WRITE]:
            f.write(json.dumps({"step": step, **sample}) + "\n")
