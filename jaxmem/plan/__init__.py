"""Memory planner: the analytic bill, the compiled figures for a (deviceless) GPU target, and verdicts."""
from __future__ import annotations

from jaxmem.runtime.aot import Topology, resolve_topology
from jaxmem import features as registry
from jaxmem.config.schema import Config
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.compiled import compile_for_plan
from jaxmem.plan.costmodel import estimate
from jaxmem.plan.report import build_plan
from jaxmem.plan.pipeline import pipeline_plan


def plan(cfg: Config, topo: Topology, *, compile: bool = True, source: str = "") -> dict:
    """The full plan dict (schema: docs/plan_schema.md) for `cfg` on `topo`."""
    if registry.for_config(cfg).has("pipeline"):  # one program per stage: jaxmem.plan.pipeline compiles each
        return pipeline_plan(cfg, topo, compile=compile, source=source)
    bill = compute_bill(cfg, topo.n_devices, gpu=_is_gpu(topo), device_memory=topo.gpu.hbm_bytes if topo.gpu else None)
    cost = estimate(cfg, bill, topo.gpu, topo.n_devices, bill.layout.grad_accum, bill.layout.rows)
    compiled = compile_for_plan(cfg, topo)[1] if compile else None
    return build_plan(cfg, topo, bill, compiled, cost, source)


def _is_gpu(topo: Topology) -> bool:
    if topo.name:
        return True
    import jax

    return jax.default_backend() == "gpu"


__all__ = ["plan", "resolve_topology", "Topology"]
