"""A plan: the analytic bill, compiled figures, verdicts and cost estimate as one JSON-able dict
(schema in docs/plan_schema.md), and its rich table."""
from __future__ import annotations

import os

from jaxmem import registry
from jaxmem.core import remat
from jaxmem.core.offload import StateHomes
from jaxmem.runtime.aot import Topology
from jaxmem.config.schema import Config, config_hash
from jaxmem.plan.bill import CATEGORIES, HOST_CATEGORIES, Bill
from jaxmem.plan.compiled import CompiledFigures
from jaxmem.plan.costmodel import Cost
from jaxmem.plan.allocator import derive
from jaxmem.io.console import make_console
from jaxmem.model.presets import param_count

SCHEMA_VERSION = 1
GIB = 1024**3


def offload_requested(cfg: Config, homes: StateHomes | None = None) -> bool:
    """Whether anything lives on the host: state (`homes`, the layout's; resolved here when not given) or
    offloaded activations."""
    homes = homes or StateHomes.from_config(cfg)
    return bool(homes.host_keys()) or bool(remat.offloaded_names(cfg.remat))


def offload_status(cfg: Config, compiled: CompiledFigures | None, homes: StateHomes | None = None) -> dict:
    requested = offload_requested(cfg, homes)
    if not requested:
        return {"requested": False, "verified": None, "message": "no offload requested"}
    if compiled is None:
        return {"requested": True, "verified": None, "message": "offload requested (not compiled: unverified)"}
    host = compiled.host_total
    if host > 0:
        amount = f"{host / GIB:.2f} GiB" if host >= GIB / 100 else f"{host / 1024**2:.2f} MiB"
        return {"requested": True, "verified": True, "message": f"offload verified: {amount} on host"}
    return {"requested": True, "verified": False, "message": "offload requested but nothing moved"}


def parameter_counts(cfg: Config) -> dict[str, int]:
    """The model's parameters ("total") and the ones a token uses ("active"), as the active features count them
    (a mixture of experts: k / E of its experts; a dense model: all)."""
    total = param_count(cfg.model)
    return registry.for_config(cfg).parameter_counts(cfg, {"total": total, "active": total})


def build_plan(cfg: Config, topo: Topology, bill: Bill, compiled: CompiledFigures | None, cost: Cost,
               source: str = "") -> dict:
    gpu = topo.gpu
    capacity = gpu.hbm_bytes if gpu else None
    usable = int(capacity * (1 - topo.headroom)) if capacity else None
    basis = "compiled" if compiled is not None else "analytic"
    device_need = compiled.run_device_peak if compiled is not None else bill.device_total
    warnings = list(compiled.warnings) if compiled is not None else []
    init = compiled.init if compiled is not None else None
    if init is not None and init.device_total > compiled.device_total:
        warnings.append(f"the run's peak is its start: building the step-0 state from {init.source} holds "
                        f"{init.device_total / GIB:.2f} GiB per device against the step's "
                        f"{compiled.device_total / GIB:.2f} GiB (both compiled); the verdict uses the larger")
    fits = None if usable is None else device_need <= usable
    if fits is False:
        warnings.append(f"does not fit: {device_need / GIB:.2f} GiB per device ({basis}) > "
                        f"{usable / GIB:.2f} GiB usable ({capacity / GIB:.2f} GiB x (1 - headroom {topo.headroom}))")
    # Host RAM: every GPU on a node parks its share there; take the larger of estimate and compile.
    host_per_device = max(bill.host_total, compiled.host_total if compiled is not None else 0,
                          init.host_total if init is not None else 0)
    host_need = host_per_device * topo.gpus_per_host
    host_fits = None if not topo.host_ram_bytes else host_need <= topo.host_ram_bytes
    if host_fits is False:
        warnings.append(f"host RAM does not fit: {host_need / GIB:.1f} GiB per node > "
                        f"{topo.host_ram_bytes / GIB:.1f} GiB")
    offload = offload_status(cfg, compiled, bill.layout.homes)
    if offload["verified"] is False:
        warnings.append(offload["message"])
    alloc = None
    if capacity:  # what `jaxmem train` would set for this plan, in this shell's environment
        alloc = derive(device_need, capacity, topo.headroom, basis).to_json()
        if alloc["warning"]:
            warnings.append(f"allocator: {alloc['warning']}")
    return {
        "schema_version": SCHEMA_VERSION,
        "config": source,
        "config_hash": config_hash(cfg, topo.label),
        "model": cfg.model.preset,
        "params": int(cost.params),
        "active_params": int(parameter_counts(cfg)["active"]),  # a mixture of experts: k / E of its experts
        "target": {"name": topo.name or "attached", "gpus_per_host": topo.gpus_per_host, "hosts": topo.hosts,
                   "device_memory_bytes": capacity, "headroom": topo.headroom,
                   "host_ram_bytes": topo.host_ram_bytes or None},
        "devices": topo.n_devices,
        "mesh": dict(bill.mesh),
        "analytic": bill.to_json(),
        "compiled": compiled.to_json() if compiled is not None else None,
        "fits": fits,
        "fits_basis": basis,
        "device_need_bytes": int(device_need),
        "usable_device_bytes": usable,
        "host_fits": host_fits,
        "host_bytes_per_node": int(host_need),
        "offload": offload,
        "allocator": alloc,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # flags change the compiled peak; train inherits them
        "analytic_vs_compiled": analytic_vs_compiled(bill.device_total,
                                                     compiled.device_total if compiled is not None else None),
        "cost": cost.to_json(),
        "warnings": warnings,
    }


def analytic_vs_compiled(analytic: int, compiled: int | None) -> dict:
    """Both device totals per device side by side; `ratio` = compiled / analytic (null without a compile)."""
    return {"analytic_device_bytes": int(analytic),
            "compiled_device_bytes": None if compiled is None else int(compiled),
            "ratio": None if compiled is None or not analytic else compiled / analytic}


# XLA's rematerialization pass logs these when its own budget is exceeded; it is not the verdict.
_XLA_REMAT = ("Can't reduce memory use below", "exceeds the base limit")
XLA_REMAT_NOTE = ("note: XLA's rematerialization warnings count pinned-host bytes too and use a limit below "
                  "device memory; the verdict uses the compiled device total")


def cost_assumptions(cost: dict) -> str:
    eff = cost.get("matmul_efficiency_assumed")
    eff = f"{eff:.0%} matmul efficiency" if eff is not None else "an assumed matmul efficiency"
    moe = ", the grouped matmul's rate by shape (H200)" if cost.get("breakdown", {}).get("expert_matmul_flops") else ""
    return (f"estimated (cost model: {eff}, per-kernel attention and loss rates{moe}, memory-bound work and "
            "per-layer overhead fitted to H100 steps, benchmarks/costmodel.md; collectives assumed overlapped)")


def _sig3(v: float) -> str:
    out = f"{v:#.3g}"
    return out[:-1] if out.endswith(".") else out


def fmt_seconds(x: float) -> str:
    """Three significant digits in s, ms or us (`1.23 s`, `45.6 ms`, `789 us`)."""
    for scale, unit in ((1, "s"), (1e-3, "ms"), (1e-6, "us")):
        if abs(x) >= scale or unit == "us":
            return f"{_sig3(x / scale)} {unit}"
    raise AssertionError


def _unit(largest: int) -> tuple[str, int]:
    return ("GiB", GIB) if largest >= GIB else ("MiB", 1024**2)


def _fmt(x, unit: tuple[str, int]) -> str:
    return "-" if x is None else f"{x / unit[1]:,.2f}"


def render(plan: dict, console=None) -> None:
    """Prints the plan as rich tables."""
    from rich.markup import escape
    from rich.table import Table

    console = console or make_console()
    a, c = plan["analytic"], plan["compiled"]
    unit = _unit(max(a["device_total"], a["host_total"], c["device_total"] if c else 0))
    _gib = lambda x: _fmt(x, unit)  # noqa: E731
    active = plan.get("active_params", plan["params"])
    params = f"{plan['params']:,} params" + (f" ({active:,} active per token)" if active != plan["params"] else "")
    title = f"{plan['config'] or plan['model']}: {params} on {plan['devices']} x " \
            f"{plan['target']['name']} (mesh {plan['mesh']})"
    bill = Table(title=title, caption=f"{unit[0]} per device")
    bill.add_column("category")
    bill.add_column("estimated (analytic)", justify="right")
    bill.add_column("host, estimated (analytic)", justify="right")
    for k in CATEGORIES:
        host = a["host"].get(k) if k in HOST_CATEGORIES else None
        bill.add_row(k, _gib(a[k]), _gib(host) if host else "")
        if k == "activations":  # its parts, by checkpoint name: they sum to it
            for name, b in a["activations_by_name"].items():
                off = a["offloaded_by_name"].get(name)
                bill.add_row(f"  saved {name}", _gib(b), _gib(off) if off else "")
            for name, b in a["offloaded_by_name"].items():
                if name not in a["activations_by_name"]:
                    bill.add_row(f"  offloaded {name}", "", _gib(b))
    bill.add_row("peak = state + activations + max(layer phase, loss phase)", _gib(a["device_total"]),
                 _gib(a["host_total"]), style="bold")
    console.print(bill)
    if c is not None:
        comp = Table(title=c["label"], caption=f"{unit[0]} per device; device = argument + output - alias + temp")
        comp.add_column("field")
        comp.add_column("device", justify="right")
        comp.add_column("host", justify="right")
        for k in ("argument", "output", "alias", "temp"):
            comp.add_row(k, _gib(c[k]), _gib(c[f"host_{k}"]))
        comp.add_row("total", _gib(c["device_total"]), _gib(c["host_total"]), style="bold")
        if c.get("init"):
            comp.add_row(f"init (the step-0 state from {c['init']['source']})", _gib(c["init"]["device_total"]),
                         _gib(c["init"]["host_total"]))
        console.print(comp)
        console.print("total: XLA's memory_analysis of the compiled step, each allocation whole; `jaxmem explain` "
                      "ranks the buffers live at once at its peak (their live ranges), which the temp allocation's "
                      "packing can leave below this total", highlight=False)
    for feature in registry.FEATURES:  # a feature's own section (a pipeline's stages)
        feature.render_plan(plan, console)
    avc = plan.get("analytic_vs_compiled")
    if avc and avc["compiled_device_bytes"] is not None:
        console.print(f"device total per device: estimated (analytic) {_gib(avc['analytic_device_bytes'])} {unit[0]} "
                      f"vs compiled {_gib(avc['compiled_device_bytes'])} {unit[0]}: "
                      f"compiled/analytic = {avc['ratio']:.3f}", highlight=False)
    cost = plan["cost"]
    share = cost["recompute_flops"] / cost["model_flops"] if cost["model_flops"] else 0.0
    extra = cost.get("breakdown", {}).get("extra_flops") or 0.0  # a feature's own passes (a reference's forward)
    extra_words = f", +{extra:.3e} in passes beside the model's (a reference's forward)" if extra else ""
    console.print(f"model FLOPs/step {cost['model_flops']:.3e} (+{cost['recompute_flops']:.3e} recompute, "
                  f"+{share:.1%}{extra_words}; matmul FLOPs only: recomputed norms, RoPE, SiLU count 0), counted by "
                  "the cost model", highlight=False)
    for note in plan["analytic"]["notes"]:  # a mixture of experts: what the analytic bill leaves out
        if note.startswith("mixture of experts"):
            console.print(f"note: {note}", highlight=False)
    if cost["step_seconds"]:
        console.print(f"step time {fmt_seconds(cost['step_seconds'])}, MFU {cost['mfu']:.1%}: "
                      f"{cost_assumptions(cost)}", highlight=False)
    verdict = {True: "[green]fits[/green]", False: "[red]does not fit[/red]", None: "no capacity known"}
    usable = plan["usable_device_bytes"]
    gib = _unit(GIB)
    console.print(f"verdict: {verdict[plan['fits']]} ({plan['fits_basis']} figure vs {_fmt(usable, gib)} GiB "
                  f"usable); host RAM: {verdict[plan['host_fits']]} "
                  f"({_fmt(plan['host_bytes_per_node'], gib)} GiB per node)")
    if plan.get("allocator"):
        a = plan["allocator"]
        cap = "no cap (platform allocator)" if a["limit_bytes"] is None else f"{_fmt(a['limit_bytes'], gib)} GiB"
        console.print(f"allocator: `jaxmem train` runs with {' '.join(f'{k}={v}' for k, v in a['env'].items())} "
                      f"(XLA may hold {cap} per device; docs/allocator.md)", highlight=False)
    if plan["offload"]["requested"]:
        console.print(plan["offload"]["message"])
    for w in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False)
    if any(m in w for w in plan["warnings"] for m in _XLA_REMAT):
        console.print(XLA_REMAT_NOTE, highlight=False)
