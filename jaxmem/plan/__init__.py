"""Memory planner: the analytic bill, the compiled figures for a (deviceless) GPU target, and verdicts."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxmem.runtime.aot import Topology, resolve_topology
from jaxmem import registry
from jaxmem.config.schema import Config
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.compiled import CompiledFigures, compile_for_plan
from jaxmem.plan.costmodel import estimate
from jaxmem.plan.generation import plan_generation
from jaxmem.plan.report import build_plan


@dataclasses.dataclass(frozen=True)
class Planner:
    """The planner's pieces a feature builds the plan of a run that is not one program with
    (jaxmem.core.plugins.Feature.plan_run: a pipeline's stages), so the feature imports nothing above it."""

    compute_bill: Callable  # jaxmem.plan.bill.compute_bill
    estimate: Callable  # jaxmem.plan.costmodel.estimate
    build_plan: Callable  # jaxmem.plan.report.build_plan
    compiled_figures: Callable  # jaxmem.plan.compiled.CompiledFigures
    build_program: Callable  # jaxmem.registry.build_program
    plan_generation: Callable  # jaxmem.plan.generation.plan_generation


PLANNER = Planner(compute_bill, estimate, build_plan, CompiledFigures, registry.build_program, plan_generation)


def plan(cfg: Config, topo: Topology, *, compile: bool = True, source: str = "") -> dict:
    """The full plan dict (schema: docs/plan_schema.md) for `cfg` on `topo`."""
    features = registry.for_config(cfg)
    own = features.plan_run(cfg, topo, PLANNER, compile=compile, source=source)  # a pipeline: one per stage
    if own is not None:
        return own
    bill = compute_bill(cfg, topo.n_devices, gpu=_is_gpu(topo), device_memory=topo.gpu.hbm_bytes if topo.gpu else None)
    cost = estimate(cfg, bill, topo.gpu, topo.n_devices, bill.layout.grad_accum, bill.layout.rows)
    compiled = compile_for_plan(cfg, topo)[1] if compile else None
    out = build_plan(cfg, topo, bill, compiled, cost, source)
    out.update(features.plan_sections(cfg, bill, cost))  # a pass before training (preference's precompute)
    return out


def _is_gpu(topo: Topology) -> bool:
    if topo.name:
        return True
    import jax

    return jax.default_backend() == "gpu"


__all__ = ["plan", "resolve_topology", "Topology", "Planner", "PLANNER"]
