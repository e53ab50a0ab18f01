"""Per-stage memory of a pipeline, from the stages' own compiled programs.

A pipeline stage is not one program: between its passes the driver holds the residuals of the micro-batches
in flight. So a stage's device figure is built from XLA's memory analysis of each of its programs, compiled
for the target (deviceless):

    layer phase  = state + gradient accumulator + params cast for the gradient
                   + in_flight x residuals of one micro-batch
                   + the larger of (forward temporaries + its input and output activations,
                                    backward temporaries + its cotangents)
    update phase = the update program's own total (state + gradients + temporaries)
    stage peak   = the larger of the two

in_flight comes from the schedule (1F1B: pp - s on stage s; GPipe: every micro-batch).
"""
from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from jaxmem import memory_kinds_shim
from jaxmem.plan.compiled import captured_stderr, memory_warnings, read_fields

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StageFigures:
    stage: int
    layers: int
    in_flight: int
    state: int  # device bytes of the stage's train state
    grads: int  # the fp32 gradient accumulator
    params_for_grad: int  # the params cast to the gradient dtype (0 when they already are)
    residuals: int  # device bytes one micro-batch's forward leaves for its backward
    residuals_host: int  # the same, offloaded to pinned host memory
    forward_peak: int  # temporaries + input and output activations of one forward
    backward_peak: int  # temporaries + cotangents of one backward
    update_total: int  # the update program's device total
    state_host: int  # host bytes of the state (optimizer offload)
    update_host: int  # the update program's host total
    compile_seconds: float
    warnings: tuple[str, ...] = ()

    @property
    def layer_phase(self) -> int:
        return (self.state + self.grads + self.params_for_grad + self.in_flight * self.residuals
                + max(self.forward_peak, self.backward_peak))

    @property
    def device_total(self) -> int:
        return max(self.layer_phase, self.update_total)

    @property
    def host_total(self) -> int:
        return max(self.update_host, self.state_host) + self.in_flight * self.residuals_host

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(layer_phase=self.layer_phase, device_total=self.device_total, host_total=self.host_total,
                   warnings=list(self.warnings))
        return out


def _with_sharding(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def compile_stage(stage, in_flight: int) -> StageFigures:
    """Compiles the stage's forward, backward and update for its mesh's devices and reads their figures."""
    prog = stage.prog
    start = time.perf_counter()
    state = prog.abstract_state
    p_grad = _with_sharding(stage.abstract_params_for_grad(), prog.state_shardings["params"])
    grads = _with_sharding(jax.eval_shape(stage._zero_grads), stage.grad_shardings)
    x, extras = stage.abstract_input(), stage.abstract_extras()
    with captured_stderr() as lines, stage.prog.lowering():
        fwd = stage.forward.lower(p_grad, x, extras).compile()
        out_avals = fwd.out_info
        res_avals = _with_sharding(out_avals[1], fwd.output_shardings[1])
        act = out_avals[0]
        ct = jax.ShapeDtypeStruct(act.shape, act.dtype, sharding=fwd.output_shardings[0])
        bwd = stage.backward.lower(p_grad, res_avals, ct, grads).compile()
        norm = jax.ShapeDtypeStruct((), jnp.float32)
        upd = stage.update.lower(state, grads, norm).compile()
    f, b, u = read_fields(fwd), read_fields(bwd), read_fields(upd)
    activation = 0 if stage.last else _shard_bytes([ct])
    received = 0 if stage.first else _shard_bytes([x])
    grad_bytes = _shard_bytes(grads)
    cast = prog.precision.param != prog.precision.grad_reduce
    return StageFigures(
        stage=stage.index, layers=stage.n_layers, in_flight=in_flight,
        state=_state_on_device(prog), grads=grad_bytes, params_for_grad=_shard_bytes(p_grad) if cast else 0,
        residuals=f["output"] - activation, residuals_host=f["host_output"],
        forward_peak=f["temp"] + received + activation,
        backward_peak=b["temp"] + activation + received,
        update_total=u["argument"] + u["output"] - u["alias"] + u["temp"],
        state_host=u["host_argument"],
        update_host=u["host_argument"] + u["host_output"] - u["host_alias"] + u["host_temp"],
        compile_seconds=round(time.perf_counter() - start, 2), warnings=tuple(memory_warnings(lines)))


def _state_on_device(prog) -> int:
    """Device bytes of the train state between passes (offloaded entries live in pinned host memory)."""
    leaves = jax.tree.leaves(prog.abstract_state)
    return _shard_bytes([a for a, s in zip(leaves, jax.tree.leaves(prog.state_shardings))
                         if not memory_kinds_shim.is_host(s)])


def _shard_bytes(tree) -> int:
    """Bytes per device of abstract arrays with shardings (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.shape else ()
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def stage_figures(pipe) -> list[StageFigures]:
    return [compile_stage(stage, pipe.schedule.in_flight[stage.index]) for stage in pipe.stages]


STAGE_COLUMNS = ("stage", "layers", "micro-batches in flight", "state", "grads (fp32 accumulator, cast params)",
                 "residuals x in flight (device)", "largest pass", "update", "device total", "host")


def stage_row(b: dict) -> list[str]:
    """One stage's bill (StageFigures.to_json) as the cells of STAGE_COLUMNS, GiB per device."""
    g = lambda x: f"{x / GIB:.2f}"  # noqa: E731
    return [str(b["stage"]), str(b["layers"]), str(b["in_flight"]), g(b["state"]), g(b["grads"] + b["params_for_grad"]),
            g(b["in_flight"] * b["residuals"]), g(max(b["forward_peak"], b["backward_peak"])), g(b["update_total"]),
            g(b["device_total"]), g(b["host_total"])]


# ---------------------------------------------------------------- `jaxmem plan` with parallel.pp > 1


def pipelined_cost(cost, bubble: float, pp: int):
    """The cost model's step (for the whole model on all devices) as a pipeline runs it: compute stretched by
    the schedule's bubble, each stage all-gathering only its own layers (estimated)."""
    compute = cost.compute_seconds / (1.0 - bubble)
    collective = cost.collective_seconds / pp
    overlapped = cost.breakdown.get("host_overlapped_seconds", 0.0)
    step = max(compute, collective, overlapped) + cost.serial_host_seconds
    mfu = cost.mfu * cost.step_seconds / step if step else 0.0
    breakdown = dict(cost.breakdown, pipeline_bubble=bubble)
    return dataclasses.replace(cost, compute_seconds=compute, collective_seconds=collective, step_seconds=step,
                               mfu=mfu, breakdown=breakdown)


def _as_compiled(fig: StageFigures, topo, pp: int):
    from jaxmem.plan.compiled import CompiledFigures

    if fig.layer_phase >= fig.update_total:
        fields = dict(argument=fig.state + fig.grads + fig.params_for_grad, output=fig.in_flight * fig.residuals,
                      alias=0, temp=max(fig.forward_peak, fig.backward_peak))
    else:
        fields = dict(argument=fig.update_total, output=0, alias=0, temp=0)
    fields.update(generated_code=0, host_argument=fig.host_total, host_output=0, host_alias=0, host_temp=0,
                  host_generated_code=0)
    label = (f"compiled for {topo.label} (deviceless), pipeline stage {fig.stage} of {pp} (the largest): state + "
             f"{fig.in_flight} micro-batches' residuals + its largest pass, from its programs' memory analyses")
    return CompiledFigures(fields, list(fig.warnings), fig.compile_seconds, label, jax.__version__)


def pipeline_plan(cfg, topo, *, compile: bool = True, source: str = "") -> dict:
    """The plan dict of a pipeline: the worst stage as the plan's compiled figure, every stage's bill under
    "pipeline", and with pp_layers=auto the even split next to the balanced one."""
    from jaxmem.plan.bill import compute_bill
    from jaxmem.plan.costmodel import estimate
    from jaxmem.plan.report import build_plan
    from jaxmem.pipeline import partition
    from jaxmem.pipeline.balance import balance
    from jaxmem.pipeline.runtime import build_pipeline

    pp = cfg.parallel.pp
    devices = list(topo.devices())
    even = None
    if compile and partition.layer_counts(cfg) is None:
        chosen = balance(cfg, devices)
        pipe = build_pipeline(cfg, devices, counts=chosen.counts)
        figures, even = chosen.figures, chosen.even_figures
    else:
        counts = partition.layer_counts(cfg) or partition.even_counts(cfg.model.n_layers, pp)
        pipe = build_pipeline(cfg, devices, counts=counts)
        figures = stage_figures(pipe) if compile else None
    worst = max(range(pp), key=lambda s: figures[s].device_total) if figures else 0
    stage = pipe.stages[worst]
    bill = compute_bill(stage.prog.cfg, topo.n_devices // pp, gpu=bool(topo.name), layout=stage.prog.layout)
    whole = compute_bill(cfg, topo.n_devices, gpu=bool(topo.name))
    cost = estimate(cfg, whole, topo.gpu, topo.n_devices, whole.layout.grad_accum, whole.layout.rows)
    if topo.gpu is not None:
        cost = pipelined_cost(cost, pipe.schedule.bubble, pp)
    compiled = _as_compiled(figures[worst], topo, pp) if figures else None
    out = build_plan(cfg, topo, bill, compiled, cost, source)
    usable = out["usable_device_bytes"]
    info = {"schedule": cfg.parallel.pp_schedule, "stages": pp, "micro_batches": pipe.schedule.micro,
            "layers": list(pipe.counts), "layers_setting": cfg.parallel.pp_layers,
            "bubble": round(pipe.schedule.bubble, 4), "in_flight": list(pipe.schedule.in_flight),
            "analytic_label": f"estimated (analytic) for stage {worst} alone, one micro-batch in flight",
            "stage_bills": [f.to_json() for f in figures] if figures else None,
            "even_layers": [f.layers for f in even] if even else None,
            "even_stage_bills": [f.to_json() for f in even] if even else None}
    out["pipeline"] = info
    if figures and usable:
        out["warnings"] += stage_warnings(figures, usable)
    return out


def stage_warnings(figures: list[StageFigures], usable: int) -> list[str]:
    """One line per stage whose compiled figure is over the usable device bytes, naming it."""
    return [f"pipeline stage {f.stage} ({f.layers} layers, {f.in_flight} micro-batches in flight) does not fit: "
            f"{f.device_total / GIB:.2f} GiB > {usable / GIB:.2f} GiB usable" for f in figures
            if f.device_total > usable]


def render_pipeline(plan: dict, console) -> None:
    info = plan.get("pipeline")
    if not info:
        return
    from rich.table import Table

    def table(title, bills):
        t = Table(title=title, caption="GiB per device, compiled for the target per stage program")
        for col in STAGE_COLUMNS:
            t.add_column(col, justify="right")
        for b in bills:
            t.add_row(*stage_row(b))
        console.print(t)

    console.print(f"pipeline: {info['stages']} stages, {info['schedule']}, {info['micro_batches']} micro-batches, "
                  f"layers {info['layers']} (pp_layers={info['layers_setting']}); bubble {info['bubble']:.1%} "
                  "(schedule simulation, backward = 2 forwards)", highlight=False)
    if info["stage_bills"]:
        table(f"pipeline stages, layers {info['layers']}", info["stage_bills"])
    if info["even_stage_bills"] and info["even_layers"] != info["layers"]:
        table(f"even split for comparison, layers {info['even_layers']}", info["even_stage_bills"])
