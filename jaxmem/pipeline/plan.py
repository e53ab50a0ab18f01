"""`jaxmem plan` for a pipeline (parallel.pp > 1): the worst stage's compiled figure as the plan's, every stage's
bill beside it (jaxmem.pipeline.figures compiles them; jaxmem.pipeline.plan_render prints them). The planner
(jaxmem.plan) calls it through the feature's plan_run hook and hands it its own pieces (jaxmem.plan.Planner):
the bill, the cost model, the plan dict and the compiled figures' type."""
from __future__ import annotations

import dataclasses

import jax

from jaxmem.pipeline import partition
from jaxmem.pipeline.balance import balance
from jaxmem.pipeline.figures import GIB, StageFigures, stage_figures
from jaxmem.pipeline.runtime import build_pipeline


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


def _as_compiled(fig: StageFigures, topo, pp: int, host: int, compiled_figures):
    """The worst stage's device figures as the plan's compiled figure (a `compiled_figures`:
    jaxmem.plan.compiled.CompiledFigures); `host`: the largest stage's host bytes (a node's GPUs may hold
    another stage than the worst, with more host state: the first's embedding)."""
    if fig.layer_phase >= fig.update_total:
        fields = dict(argument=fig.state + fig.grads + fig.params_for_grad, output=fig.in_flight * fig.residuals,
                      alias=0, temp=max(fig.forward_peak, fig.backward_peak))
    else:
        fields = dict(argument=fig.update_total, output=0, alias=0, temp=0)
    fields.update(generated_code=0, host_argument=host, host_output=0, host_alias=0, host_temp=0,
                  host_generated_code=0)
    label = (f"compiled for {topo.label} (deviceless), pipeline stage {fig.stage} of {pp} (the largest): state + "
             f"{fig.in_flight} micro-batches' residuals + its largest pass, from its programs' memory analyses; "
             f"host: the largest stage's")
    return compiled_figures(fields, list(fig.warnings), fig.compile_seconds, label, jax.__version__)


def pipeline_plan(cfg, features, topo, planner, *, compile: bool = True, source: str = "") -> dict:
    """The plan dict of a pipeline: the worst stage as the plan's compiled figure, every stage's bill under
    "pipeline", and with pp_layers=auto the even split next to the balanced one; `features`: the ones `cfg`
    turns on, `planner`: the planner's pieces (jaxmem.plan.Planner)."""
    pp = cfg.parallel.pp
    devices = list(topo.devices())
    even = None
    if compile and partition.layer_counts(cfg) is None:
        chosen = balance(cfg, devices, features=features)
        pipe = build_pipeline(cfg, devices, counts=chosen.counts, features=features)
        figures, even = chosen.figures, chosen.even_figures
    else:
        counts = partition.layer_counts(cfg) or partition.even_counts(cfg.model.n_layers, pp)
        pipe = build_pipeline(cfg, devices, counts=counts, features=features)
        figures = stage_figures(pipe) if compile else None
    worst = max(range(pp), key=lambda s: figures[s].device_total) if figures else 0
    stage = pipe.stages[worst]
    bill = planner.compute_bill(stage.prog.cfg, topo.n_devices // pp, gpu=bool(topo.name), layout=stage.prog.layout)
    whole = planner.compute_bill(cfg, topo.n_devices, gpu=bool(topo.name))
    cost = planner.estimate(cfg, whole, topo.gpu, topo.n_devices, whole.layout.grad_accum, whole.layout.rows)
    if topo.gpu is not None:
        cost = pipelined_cost(cost, pipe.schedule.bubble, pp)
    host = max(f.host_total for f in figures) if figures else 0
    compiled = _as_compiled(figures[worst], topo, pp, host, planner.compiled_figures) if figures else None
    out = planner.build_plan(cfg, topo, bill, compiled, cost, source)
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
