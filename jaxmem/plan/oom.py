"""OOM forensics: parse XLA's out-of-memory text (bytes asked, free), size the shortfall against the analytic
bill, and rank the config levers that would free it by their added step time (no compiles).

Message formats (exact text, where each comes from):
  * `Out of memory while trying to allocate 8.02GiB with allocator GPU_0_bfc on device 0.` -- the PJRT GPU
    client's BFC allocator, recorded on a GPU run (jax 0.11.2); also nested in the autotuner's
    `NOT_FOUND: All configs failed during profiling ... EXECUTION FAILED: RESOURCE_EXHAUSTED: ...`.
    The string `memory while trying to allocate ` is in jax_plugins/xla_cuda12/xla_cuda_plugin.so (0.10.2).
  * `Out of memory while trying to allocate 8606711808 bytes.` -- the same prefix with a byte count (older
    XLA GPU executables; the size regex takes `bytes` as a unit).
  * `Allocator (GPU_0_bfc) ran out of memory trying to allocate 8.02GiB (rounded to 8606711808)` --
    xla/tsl/framework/bfc_allocator.cc (`) ran out of memory trying ` in xla_cuda_plugin.so).
  * `Failed to allocate request for 8.02GiB (8606711808B) on device ordinal 0` -- the stream executor's
    device memory allocator (format `Failed to allocate request for %s (%uB) on device ordinal %d` in
    xla_cuda_plugin.so).
  * `Out of memory allocating 8606711808 bytes.` -- jaxlib (format `Out of memory allocating %d bytes.` in
    jaxlib/libjax_common.so).
  * `... N bytes free, ...` -- free bytes next to a request (` bytes free, ` in xla_cuda_plugin.so).
  * `Can't reduce memory use below 70.00GiB (75161927680 bytes) by rematerialization; only reduced to
    80.00GiB (85899345920 bytes), down from ...` -- xla/service/hlo_rematerialization.cc at compile (format
    in xla_cuda_plugin.so): the limit and the peak it could not get under.
"""
from __future__ import annotations

import dataclasses
import re

from jaxmem.runtime.oom_text import is_oom  # noqa: F401 (the predicate lives below its users; re-exported)
from jaxmem.config.schema import Config, ConfigError
from jaxmem.config import apply_overrides, to_dict
from jaxmem.loader import from_dict
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.costmodel import estimate

_UNITS = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"(\d+(?:\.\d+)?)\s*(TiB|GiB|MiB|KiB|bytes|B)\b"
ANALYTIC, COST = "estimated (analytic)", "estimated (cost model)"


def to_bytes(number: str, unit: str) -> int:  # "8.02", "GiB" -> round(8.02 * 2**30)
    return int(round(float(number) * _UNITS[unit]))


def exc_text(exc: BaseException) -> str:
    """The text of `exc` and of the errors it wraps (a TrainError keeps only XLA's first line itself)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


@dataclasses.dataclass
class OomMessage:
    asked_bytes: int | None = None  # the allocation that failed
    free_bytes: int | None = None
    limit_bytes: int | None = None  # compile-time remat: the memory limit
    peak_bytes: int | None = None  # compile-time remat: the peak it reduced to
    form: str = ""  # which format matched

    @property
    def missing_bytes(self) -> int | None:
        if self.peak_bytes is not None and self.limit_bytes is not None:
            return max(0, self.peak_bytes - self.limit_bytes)
        if self.asked_bytes is not None and self.free_bytes is not None:
            return max(0, self.asked_bytes - self.free_bytes)
        return None


_ASKED = (  # (form, regex, group of the exact byte count or None: the size group pair 1, 2)
    ("stream_executor", rf"Failed to allocate request for {_SIZE} \((\d+)B\)", 3),
    ("bfc_rounded", rf"ran out of memory trying to allocate {_SIZE} \(rounded to (\d+)\)", 3),
    ("pjrt_bfc", rf"Out of memory while trying to allocate {_SIZE}", None),
    ("jaxlib", r"Out of memory allocating (\d+) bytes", 1),
)
_REMAT = re.compile(rf"Can't reduce memory use below {_SIZE} \((\d+) bytes\) by rematerialization; only reduced "
                    rf"to {_SIZE} \((\d+) bytes\)")
_FREE = re.compile(rf"{_SIZE} free")


def parse_oom(text: str) -> OomMessage:
    out = OomMessage()
    m = _REMAT.search(text)
    if m:
        out.limit_bytes, out.peak_bytes, out.form = int(m.group(3)), int(m.group(6)), "remat_limit"
    for form, rx, group in _ASKED:
        m = re.search(rx, text)
        if m:
            out.asked_bytes = int(m.group(group)) if group else to_bytes(m.group(1), m.group(2))
            out.form = out.form or form
            break
    m = _FREE.search(text)
    if m:
        out.free_bytes = to_bytes(m.group(1), m.group(2))
    return out


def _candidates(cfg: Config, grad_accum: int) -> list[list[str]]:
    out = [["remat.preset=full"], ["remat.preset=selective"], ["remat.preset=offload_layer_inputs"],
           ["offload.optimizer=host"], ["precision.grad_reduce_dtype=bfloat16"], ["parallel.zero_stage=3"],
           ["kernels.loss=chunked"], ["kernels.attention=pallas"],
           ["optimizer.update_in_backward=true", "remat.preset=full"]]
    if cfg.train.micro_batch >= 2:
        out.append([f"train.micro_batch={cfg.train.micro_batch // 2}", f"train.grad_accum={grad_accum * 2}"])
    return out


def _override(cfg: Config, overrides: list[str]) -> Config:
    return from_dict(apply_overrides(to_dict(cfg), overrides))


def bill_and_cost(cfg: Config, n_devices: int, gpu):
    bill = compute_bill(cfg, n_devices, gpu=True)
    return bill, estimate(cfg, bill, gpu, n_devices, bill.layout.grad_accum, bill.layout.rows)


def rank_levers(cfg: Config, n_devices: int, gpu, missing: int | None, base=None) -> tuple[list[dict], bool]:
    """Levers (override sets) that free >= `missing` device bytes, cheapest added step time first; when none
    does (or `missing` is unknown), the 3 that free the most. Returns (levers, whether they cover `missing`)."""
    bill, cost = base or bill_and_cost(cfg, n_devices, gpu)
    found = []
    for ovs in _candidates(cfg, bill.layout.grad_accum):
        try:
            b2, c2 = bill_and_cost(_override(cfg, ovs), n_devices, gpu)
        except (ConfigError, ValueError, NotImplementedError):  # the loader (or layout) refuses it here
            continue
        freed = bill.device_total - b2.device_total
        if freed <= 0:
            continue
        found.append({"overrides": ovs, "frees_bytes": int(freed), "device_total_bytes": int(b2.device_total),
                      "added_step_seconds": float(c2.step_seconds - cost.step_seconds),
                      "step_seconds": float(c2.step_seconds), "bytes_label": ANALYTIC, "time_label": COST})
    enough = [x for x in found if missing is not None and x["frees_bytes"] >= missing]
    chosen = enough or sorted(found, key=lambda x: -x["frees_bytes"])[:3]
    return sorted(chosen, key=lambda x: (x["added_step_seconds"], -x["frees_bytes"])), bool(enough)


def allocator_limit(gpu) -> tuple[int | None, str]:
    """The device's allocator limit (memory_stats bytes_limit), else the target's HBM x 0.75 (labeled)."""
    try:
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"]), "Device.memory_stats()['bytes_limit']"
    except Exception:
        pass
    if gpu is not None:
        return int(gpu.hbm_bytes * 0.75), f"assumed: {gpu.name} HBM x 0.75 (XLA's default preallocation)"
    return None, "unknown (no memory_stats, no GPU target)"


def forensics(cfg: Config, text: str, n_devices: int, gpu, limit: tuple[int | None, str] | None = None) -> dict:
    """The OOM report as a JSON-able dict (no compile)."""
    msg = parse_oom(text)
    base = bill_and_cost(cfg, n_devices, gpu)
    bill = base[0]
    limit_bytes, limit_label = limit or allocator_limit(gpu)
    missing, missing_label = msg.missing_bytes, f"from XLA's message ({msg.form})"
    if missing is None and limit_bytes is not None:
        missing = max(0, bill.device_total - limit_bytes)
        missing_label = f"{ANALYTIC}: plan device total - allocator limit ({limit_label})"
    missing_label = missing_label if missing is not None else "unknown"
    levers, covers = rank_levers(cfg, n_devices, gpu, missing, base)
    return {"message": text[:4000], "parsed": {**dataclasses.asdict(msg), "missing_bytes": msg.missing_bytes},
            "allocator_limit_bytes": limit_bytes, "allocator_limit_label": limit_label,
            "missing_bytes": missing, "missing_label": missing_label,
            "target": gpu.name if gpu is not None else "", "n_devices": n_devices,
            "bill": bill.to_json(), "step_seconds": float(base[1].step_seconds), "step_seconds_label": COST,
            "levers": levers, "levers_cover_missing": covers}


def render(report: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    gib = lambda b: "?" if b is None else f"{b / 2**30:,.2f} GiB"  # noqa: E731
    p = report["parsed"]
    free = "not in the message" if p["free_bytes"] is None else gib(p["free_bytes"])
    console.print(f"[red]out of memory[/red] ({escape(p['form'] or 'unparsed message')}): asked "
                  f"{gib(p['asked_bytes'])}, free {free}; missing {gib(report['missing_bytes'])} "
                  f"({escape(report['missing_label'])})", highlight=False)
    bill = report["bill"]
    t = Table(title=f"plan bill per device, {report['n_devices']} x {report['target'] or 'attached'}",
              caption=ANALYTIC)
    t.add_column("category")
    t.add_column("GiB", justify="right")
    for k, v in bill.items():
        if isinstance(v, int) and k not in ("device_total", "host_total"):
            t.add_row(k, f"{v / 2**30:,.2f}")
    t.add_row("[b]device total[/b]", f"[b]{bill['device_total'] / 2**30:,.2f}[/b]")
    console.print(t)
    head = "levers that free the missing bytes" if report["levers_cover_missing"] else \
        "no single lever frees the missing bytes; the 3 that free the most"
    t = Table(title=f"{head}, by added step time", caption=f"bytes {ANALYTIC}, step time {COST}")
    for col in ("#", "overrides", "frees GiB", "device total GiB", "added step ms"):
        t.add_column(col, justify="left" if col == "overrides" else "right")
    for i, x in enumerate(report["levers"], 1):
        t.add_row(str(i), escape(" ".join(x["overrides"])), f"{x['frees_bytes'] / 2**30:,.2f}",
                  f"{x['device_total_bytes'] / 2**30:,.2f}", f"{x['added_step_seconds'] * 1e3:+,.1f}")
    console.print(t)
