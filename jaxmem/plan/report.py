"""A plan: the analytic bill, compiled figures, verdicts and cost estimate as one JSON-able dict
(schema in docs/plan_schema.md), and its rich table."""
from __future__ import annotations

from jaxmem import remat
from jaxmem.aot import Topology
from jaxmem.schema import Config, config_hash
from jaxmem.plan.bill import CATEGORIES, HOST_CATEGORIES, Bill
from jaxmem.plan.compiled import CompiledFigures
from jaxmem.plan.costmodel import Cost

SCHEMA_VERSION = 1
GIB = 1024**3


def offload_requested(cfg: Config) -> bool:
    return (cfg.offload.optimizer == "host" or cfg.offload.params == "host"
            or bool(remat.offloaded_names(cfg.remat)))


def offload_status(cfg: Config, compiled: CompiledFigures | None) -> dict:
    requested = offload_requested(cfg)
    if not requested:
        return {"requested": False, "verified": None, "message": "no offload requested"}
    if compiled is None:
        return {"requested": True, "verified": None, "message": "offload requested (not compiled: unverified)"}
    host = compiled.host_total
    if host > 0:
        amount = f"{host / GIB:.2f} GiB" if host >= GIB / 100 else f"{host / 1024**2:.2f} MiB"
        return {"requested": True, "verified": True, "message": f"offload verified: {amount} on host"}
    return {"requested": True, "verified": False, "message": "offload requested but nothing moved"}


def build_plan(cfg: Config, topo: Topology, bill: Bill, compiled: CompiledFigures | None, cost: Cost,
               source: str = "") -> dict:
    gpu = topo.gpu
    capacity = gpu.hbm_bytes if gpu else None
    usable = int(capacity * (1 - topo.headroom)) if capacity else None
    basis = "compiled" if compiled is not None else "analytic"
    device_need = compiled.device_total if compiled is not None else bill.device_total
    warnings = list(compiled.warnings) if compiled is not None else []
    fits = None if usable is None else device_need <= usable
    if fits is False:
        warnings.append(f"does not fit: {device_need / GIB:.2f} GiB per device ({basis}) > "
                        f"{usable / GIB:.2f} GiB usable ({capacity / GIB:.2f} GiB x (1 - headroom {topo.headroom}))")
    # Host RAM: every GPU on a node parks its share there; take the larger of estimate and compile.
    host_per_device = max(bill.host_total, compiled.host_total if compiled is not None else 0)
    host_need = host_per_device * topo.gpus_per_host
    host_fits = None if not topo.host_ram_bytes else host_need <= topo.host_ram_bytes
    if host_fits is False:
        warnings.append(f"host RAM does not fit: {host_need / GIB:.1f} GiB per node > "
                        f"{topo.host_ram_bytes / GIB:.1f} GiB")
    offload = offload_status(cfg, compiled)
    if offload["verified"] is False:
        warnings.append(offload["message"])
    return {
        "schema_version": SCHEMA_VERSION,
        "config": source,
        "config_hash": config_hash(cfg, topo.label),
        "model": cfg.model.preset,
        "params": int(cost.params),
        "target": {"name": topo.name or "attached", "gpus_per_host": topo.gpus_per_host, "hosts": topo.hosts,
                   "device_memory_bytes": capacity, "headroom": topo.headroom,
                   "host_ram_bytes": topo.host_ram_bytes or None},
        "devices": topo.n_devices,
        "mesh": dict(bill.mesh),
        "analytic": bill.to_json(),
        "compiled": compiled.to_json() if compiled is not None else None,
        "fits": fits,
        "fits_basis": basis,
        "usable_device_bytes": usable,
        "host_fits": host_fits,
        "host_bytes_per_node": int(host_need),
        "offload": offload,
        "cost": cost.to_json(),
        "warnings": warnings,
    }


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.3f} ms"


def _unit(largest: int) -> tuple[str, int]:
    return ("GiB", GIB) if largest >= GIB else ("MiB", 1024**2)


def _fmt(x, unit: tuple[str, int]) -> str:
    return "-" if x is None else f"{x / unit[1]:,.2f}"


def render(plan: dict, console=None) -> None:
    """Prints the plan as rich tables."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    a, c = plan["analytic"], plan["compiled"]
    unit = _unit(max(a["device_total"], a["host_total"], c["device_total"] if c else 0))
    _gib = lambda x: _fmt(x, unit)  # noqa: E731
    title = f"{plan['config'] or plan['model']}: {plan['params']:,} params on {plan['devices']} x " \
            f"{plan['target']['name']} (mesh {plan['mesh']})"
    bill = Table(title=title, caption=f"{unit[0]} per device")
    bill.add_column("category")
    bill.add_column("estimated (analytic)", justify="right")
    bill.add_column("host, estimated (analytic)", justify="right")
    for k in CATEGORIES:
        host = a["host"].get(k) if k in HOST_CATEGORIES else None
        bill.add_row(k, _gib(a[k]), _gib(host) if host else "")
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
        console.print(comp)
    cost = plan["cost"]
    console.print(f"model FLOPs/step {cost['model_flops']:.3e} (+{cost['recompute_flops']:.3e} recompute); "
                  + (f"step {_seconds(cost['step_seconds'])}, MFU {cost['mfu']:.1%} " if cost["step_seconds"] else "")
                  + "- estimated (cost model)")
    verdict = {True: "[green]fits[/green]", False: "[red]does not fit[/red]", None: "no capacity known"}
    usable = plan["usable_device_bytes"]
    gib = _unit(GIB)
    console.print(f"verdict: {verdict[plan['fits']]} ({plan['fits_basis']} figure vs {_fmt(usable, gib)} GiB "
                  f"usable); host RAM: {verdict[plan['host_fits']]} "
                  f"({_fmt(plan['host_bytes_per_node'], gib)} GiB per node)")
    if plan["offload"]["requested"]:
        console.print(plan["offload"]["message"])
    for w in plan["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False)
