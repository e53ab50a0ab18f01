"""`jaxmem plan` of a GRPO config (train.objective=grpo, through the feature's plan_run hook, handed the
planner's pieces): its programs compiled for the target, each with the train state beside it. The rollout
phase is the generation program (prefill + decode loop over rl.generation_batch rows, the KV cache) while the
rest of the train state (optimizer moments, master weights) stays on the device; the log-prob phase is the
forward passes, once per rollout and one micro-batch at a time, of the old policy and (rl.beta > 0) the
reference; the training phase is the objective step on the rollout's batch. The run's peak is the largest
phase (what stays live across the phases, the train state, plus the phase's own peak). Without compile each
phase is estimated (jaxmem.rl.plan_estimate)."""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxmem.config.schema import Config
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.core.plugins import FROZEN
from jaxmem.mesh import sharding
from jaxmem.rl import plan_estimate
from jaxmem.rl.rollout import jit_train_step, logprob_fns
from jaxmem.runtime.aot import Topology
from jaxmem.runtime.compiled_memory import captured_stderr, device_bytes, read_fields


def rollout_config(cfg: Config) -> Config:
    """`cfg` with a generate: section sized like one decode of its rollouts (rl.generation_batch rows; the plan
    rounds the lengths up to buckets, so powers of two are planned exactly)."""
    rl = cfg.rl
    generate = dataclasses.replace(cfg.generate, batch=rl.rollout_rows,
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


def compiled_phases(cfg: Config, topo: Topology, planner, rollout: dict) -> tuple[dict, dict]:
    """({phase: {"peak", "label", and its figures}}, the training program's fields) per device, each program
    compiled for `topo`; `rollout`: the compiled plan_generation of rollout_config(cfg)."""
    with captured_stderr():
        prog = planner.build_program(cfg, devices=list(topo.devices()))
    training = _training(cfg, prog)
    logprobs = _logprob_passes(cfg, prog, training["state_bytes"])
    label = rollout["label"]
    rollout_peak = rollout["device_peak"] - rollout["fields"]["argument"] + training["state_bytes"]
    phases = {"rollout": dict(rollout, peak=rollout_peak, label=label),
              "logprobs": dict(logprobs, peak=logprobs["phase_peak"], label=label),
              "training": dict(training, peak=training["device_peak"], label=label)}
    return phases, dict(training["fields"], live_across=training["state_bytes"])


def plan_rl(cfg: Config, topo: Topology, planner, compile: bool = True, source: str = "") -> dict:
    """The plan dict (docs/plan_schema.md) of a GRPO run per device: the training step's bill and cost (the
    cost with the rollout and log-prob passes added, jaxmem.rl.plan_estimate), the largest phase as the
    compiled figure (compile) or the estimated one, the verdict on the run's peak, and under "rl" each phase;
    "lines": the rendered summary. `planner`: jaxmem.plan.Planner."""
    bill = planner.compute_bill(cfg, topo.n_devices, gpu=bool(topo.name),
                                device_memory=topo.gpu.hbm_bytes if topo.gpu else None)
    cost = planner.estimate(cfg, bill, topo.gpu, topo.n_devices, bill.layout.grad_accum, bill.layout.rows)
    generation = planner.plan_generation(rollout_config(cfg), topo, compile=compile, bucket_rows=False)
    estimated = plan_estimate.estimated_phases(cfg, bill, generation["cache_bytes"])
    live = plan_estimate.state_bytes(bill)
    compiled = None
    phases = estimated
    if compile:
        start = time.perf_counter()
        phases, fields = compiled_phases(cfg, topo, planner, generation)
        live = fields.pop("live_across")
        compiled = _as_compiled(phases, live, fields, planner.compiled_figures, time.perf_counter() - start)
    run_cost = plan_estimate.run_cost(cfg, cost, bill, topo.gpu, generation["cache_bytes"])
    out = planner.build_plan(cfg, topo, bill, compiled, run_cost, source)
    peak_phase = max(phases, key=lambda name: phases[name]["peak"])
    estimated_peak = max(p["peak"] for p in estimated.values())
    out["analytic"] = dict(out["analytic"], device_total=estimated_peak, step_device_total=bill.device_total,
                           label="estimated (analytic): the largest of the GRPO run's phases")
    _verdict(out, phases[peak_phase]["peak"], peak_phase, phases[peak_phase]["label"])
    out["peak_phase"] = peak_phase
    out["rl"] = {"phases": phases, "estimated": estimated, "live_across": live, "run_peak": phases[peak_phase]["peak"],
                 "rollout_rows": cfg.rl.rollout_rows, "cache_bytes": generation["cache_bytes"],
                 "label": phases[peak_phase]["label"], "seconds": {k: run_cost.breakdown[f"{k}_seconds"] for k in
                                                                    ("rollout", "logprob", "training")}}
    return dict(out, lines=render_lines(out))


def _as_compiled(phases: dict, live: int, training_fields: dict, compiled_figures, seconds: float):
    """The largest phase as the plan's compiled figure (`compiled_figures`: jaxmem.plan.compiled.CompiledFigures):
    the train state as its argument, the phase's own bytes as its temp; the host side the training step's."""
    worst = max(phases, key=lambda name: phases[name]["peak"])
    fields = dict(argument=live, output=0, alias=0, temp=phases[worst]["peak"] - live, generated_code=0,
                  **{k: v for k, v in training_fields.items() if k.startswith("host_")})
    label = f"{phases[worst]['label']}: the GRPO run's {worst} phase (the largest), beside the train state"
    return compiled_figures(fields, [], seconds, label, jax.__version__)


def _verdict(out: dict, peak: int, phase: str, label: str) -> None:
    """The plan's verdict on the run's peak (the largest phase), named by the phase where it does not fit."""
    usable = out["usable_device_bytes"]
    out["device_need_bytes"] = int(peak)
    out["fits"] = None if usable is None else peak <= usable
    out["warnings"] = [w for w in out["warnings"] if not w.startswith("does not fit:")]
    if out["fits"] is False:
        out["warnings"].append(f"does not fit: the {phase} phase holds {peak / 2**30:.3f} GiB per device ({label}) > "
                               f"{usable / 2**30:.3f} GiB usable")


NAMES = {"rollout": "rollout phase", "logprobs": "log-prob phase", "training": "training phase"}


def render_lines(plan: dict) -> list[str]:
    gib = lambda n: f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"  # noqa: E731
    rl, usable = plan["rl"], plan["usable_device_bytes"]
    phases = rl["phases"]
    what = {"rollout": f"generation of {rl['rollout_rows']} completions at a time (KV cache {gib(rl['cache_bytes'])}"
                       ", analytic) beside the state",
            "logprobs": "the forward passes of the old" + (" and reference" if "reference" in phases["logprobs"].get(
                "passes", {}) else "") + " log-probs, one micro-batch at a time, beside the state",
            "training": "the GRPO step on the rollout's batch"}
    verdict = "capacity unknown" if usable is None else ("fits" if plan["fits"] else "does not fit") + \
        f" in {gib(usable)} usable"
    lines = [f"GRPO plan per device ({rl['label']}):",
             f"  live across the phases (the train state): {gib(rl['live_across'])}"]
    for name, phase in phases.items():
        seconds = rl["seconds"]["logprob" if name == "logprobs" else name]
        timed = f"; {seconds:.3g} s per step (estimated)" if usable is not None else ""  # no GPU: no time
        lines.append(f"  {NAMES[name]}: {what[name]}: {gib(phase['peak'])} ({phase['label']}){timed}")
    lines.append(f"  run peak: {gib(rl['run_peak'])} in the {NAMES[plan['peak_phase']]}: {verdict}")
    return lines
