"""`jaxmem plan` of a GRPO config (train.objective=grpo, through the feature's plan_run hook, handed the
planner's pieces): its programs compiled for the target, each with the train state beside it. The rollout
phase is the generation program (prefill + decode loop over rl.generation_batch rows, the KV cache) while the
rest of the train state (optimizer moments, master weights) stays on the device; the log-prob phase is the
forward passes, once per rollout and one micro-batch at a time, of the old policy and (rl.beta > 0) the
reference; the training phase is the objective step on the rollout's batch. The run's peak is the largest
phase. The analytic bill does not price GRPO: a plan without compile is refused."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxmem.config.schema import Config, ConfigError
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.core.plugins import FROZEN
from jaxmem.mesh import sharding
from jaxmem.rl.rollout import jit_train_step, logprob_fns
from jaxmem.runtime.aot import Topology
from jaxmem.runtime.compiled_memory import captured_stderr, device_bytes, read_fields


def rollout_config(cfg: Config) -> Config:
    """`cfg` with a generate: section sized like one decode of its rollouts (rl.generation_batch rows; the plan
    rounds the lengths up to buckets, so powers of two are planned exactly)."""
    rl = cfg.rl
    generate = dataclasses.replace(cfg.generate, batch=rl.generation_batch or rl.prompts_per_step * rl.group_size,
                                   prompt_len=rl.max_prompt_len, max_new_tokens=rl.max_completion_len)
    return dataclasses.replace(cfg, generate=generate)


def _training(cfg: Config, prog) -> dict:
    step = jit_train_step(prog)
    batch = prog.abstract_batch()  # the rollout's (jaxmem.rl.objective.abstract_batch)
    with captured_stderr(), prog.lowering():
        fields = read_fields(step.lower(prog.abstract_state, batch).compile())
    per_device = lambda a: a.dtype.itemsize * _prod(a.sharding.shard_shape(a.shape))  # noqa: E731
    batch_bytes = sum(per_device(a) for a in batch.values())
    return {"device_peak": device_bytes(fields), "state_bytes": fields["argument"] - batch_bytes, "fields": fields}


def _logprob_passes(cfg: Config, prog, state_bytes: int) -> dict:
    """The once-per-rollout forward passes on one micro-batch (prog.rows rows): each pass's peak with its
    weight arguments replaced by the whole train state, and the phase's peak (the larger pass)."""
    policy, reference = logprob_fns(prog)
    rows = NamedSharding(prog.mesh, P(sharding.batch_spec(prog.mesh)[0], None))
    tokens = jax.ShapeDtypeStruct((prog.rows, cfg.train.seq_len), jnp.int32, sharding=rows)
    weights = (prog.abstract_state["params"], prog.abstract_state.get(FROZEN))
    passes = {"old": policy, **({"reference": reference} if cfg.rl.beta > 0 else {})}
    out = {}
    for name, fn in passes.items():
        with captured_stderr(), prog.lowering():
            fields = read_fields(fn.lower(*weights, tokens, tokens).compile())
        out[name] = {"device_peak": device_bytes(fields), "fields": fields,
                     "phase_peak": device_bytes(fields) - fields["argument"] + state_bytes}
    return {"passes": out, "rows": prog.rows, "phase_peak": max(p["phase_peak"] for p in out.values())}


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def plan_rl(cfg: Config, topo: Topology, planner, compile: bool = True) -> dict:
    """{"rollout": {...}, "training": {...}, "live_across": bytes, "run_peak": bytes, "label", "lines": the
    rendered summary} per device; `planner`: jaxmem.plan.Planner (build_program, plan_generation)."""
    if not compile:
        raise ConfigError("plan --no-compile: the analytic bill does not price train.objective=grpo; plan it "
                          "compiled (its rollout and training programs)")
    start = time.perf_counter()
    with captured_stderr():
        prog = planner.build_program(cfg, devices=list(topo.devices()))
    training = _training(cfg, prog)
    logprobs = _logprob_passes(cfg, prog, training["state_bytes"])
    rollout = planner.plan_generation(rollout_config(cfg), topo, compile=True)
    weights_in_rollout = rollout["fields"]["argument"]
    rollout_total = rollout["device_peak"] - weights_in_rollout + training["state_bytes"]
    where = f"{topo.label} (deviceless)" if topo.name else f"{topo.label} (attached devices)"
    peak = max(rollout_total, logprobs["phase_peak"], training["device_peak"])
    result = {"rollout": dict(rollout, phase_peak=rollout_total), "logprobs": logprobs, "training": training,
              "live_across": training["state_bytes"], "run_peak": peak, "label": f"compiled for {where}",
              "compile_seconds": round(time.perf_counter() - start, 2),
              "fits": None if topo.gpu is None else peak <= topo.gpu.hbm_bytes}
    return dict(result, lines=render_lines(result))


def render_lines(result: dict) -> list[str]:
    gib = lambda n: f"{n / 2**30:.3f} GiB"  # noqa: E731
    r = result["rollout"]
    return [f"GRPO plan per device ({result['label']}):",
            f"  live across the phases (the train state): {gib(result['live_across'])}",
            f"  rollout phase: generation of {r['batch']} completions (prompt bucket {r['prompt_bucket']}, "
            f"{r['new_bucket']} new, {r['cache_dtype']} KV cache {gib(r['cache_bytes'])}) beside the state: "
            f"{gib(r['phase_peak'])}",
            f"  log-prob phase: the forward passes of the {' and '.join(result['logprobs']['passes'])} log-probs, "
            f"{result['logprobs']['rows']} row(s) at a time, beside the state: {gib(result['logprobs']['phase_peak'])}",
            f"  training phase: the GRPO step on the rollout's batch: {gib(result['training']['device_peak'])}",
            f"  run peak: {gib(result['run_peak'])}"]
