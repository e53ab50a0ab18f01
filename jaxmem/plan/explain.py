"""`jaxmem explain CONFIG [--target T] [--top N] [--json FILE]`: the buffers live at the memory peak of
the compiled train step, each with its category, the jaxmem source line that created it, and a fix.
`--html/--plot/--timeline-json [--compare OTHER.yaml]`: the step's memory timeline (jaxmem.plan.timeline).

Also `report_oom(cfg, exc)`, for the training loop: explain an out-of-memory instead of XLA's raw text.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxmem.runtime.aot import Topology, resolve_topology
from jaxmem.config import Config, to_dict
from jaxmem.loader import from_dict
from jaxmem.plan import compile_failure, hlo_dump
from jaxmem.plan.buffer_kinds import classify, state_shapes
from jaxmem.runtime.compiled_memory import memory_figures
from jaxmem.registry import build_program
from jaxmem.plan.timeline import build
from jaxmem.config.targets import target_for_device_kind
from jaxmem.plan import oom
from jaxmem.io.console import make_console, make_wrapping_console
from jaxmem.io.no_follow import write_text
from jaxmem.config.schema import ConfigError
from jaxmem.plan.report import _fmt, _unit


# ------------------------------------------------------------------ compiling with dumps


def _worker(cfg_json: str, topo_json: str) -> None:
    """Runs in a fresh process whose XLA_FLAGS ask for dumps: compile only."""
    cfg = from_dict(json.loads(cfg_json))
    topo = Topology(**json.loads(topo_json))
    prog = build_program(cfg, devices=list(topo.devices()))
    label = f"{topo.label} ({'deviceless' if topo.name else 'attached devices'})"
    try:
        with compile_failure.one_line(cfg, label, prog.layout.kernels):
            compiled = prog.lower().compile()
    except compile_failure.CompileFailed as e:  # the parent prints it as one line
        print(json.dumps({"compile_failed": str(e)}))
        return
    print(json.dumps(memory_figures(compiled)))


def compile_with_dumps(cfg: Config, topo: Topology, dump_dir: Path) -> dict:
    """Compiles in a fresh process whose XLA_FLAGS ask for dumps into `dump_dir`; returns the compile's
    memory figures (jaxmem.runtime.compiled_memory.memory_figures)."""
    flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"
    # the persistent compilation cache off: a step read back from it is not compiled, so XLA writes no dump
    env = dict(os.environ, JAX_PLATFORMS="cpu" if topo.name else os.environ.get("JAX_PLATFORMS", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip(), JAX_ENABLE_COMPILATION_CACHE="false")
    topo_json = json.dumps({k: getattr(topo, k) for k in ("name", "gpus_per_host", "hosts", "headroom",
                                                         "host_ram_bytes")})
    code = "import sys; from jaxmem.plan.explain import _worker; _worker(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(to_dict(cfg)), topo_json], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"explain: the dump compile failed:\n{tail}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    if "compile_failed" in figures:
        raise compile_failure.CompileFailed(figures["compile_failed"])
    return figures


def explain_dump(cfg: Config, dump_dir: Path, top: int = 10) -> dict:
    hlo_path, live_path, usage_path = hlo_dump.find_dump(Path(dump_dir))
    module = hlo_dump.HloModuleText(hlo_path.read_text())
    assignment = hlo_dump.buffer_assignment_path(live_path)
    peak, host = hlo_dump.device_peak_buffers(live_path.read_text(),
                                              assignment.read_text() if assignment.exists() else "")
    total = sum(b for _, _, b in peak)
    ranked = sorted(peak, key=lambda x: -x[2])[:top]
    state = state_shapes(cfg, module)
    buffers = [classify(cfg, module, n, i, b, state) for n, i, b in ranked]
    usage = usage_path.read_text().splitlines()[1].strip() if usage_path else ""
    return {"peak_live_bytes": total, "host_live_bytes": host, "buffers": buffers, "memory_usage_report": usage}


def explain(cfg: Config, topo: Topology, top: int = 10, dump_dir: str | None = None) -> dict:
    """Compiles with dumps in a subprocess and explains the peak (bytes are compiled, deviceless for a target)."""
    return explain_with_timeline(cfg, topo, top, dump_dir, timeline=False)[0]


def explain_with_timeline(cfg: Config, topo: Topology, top: int = 10, dump_dir: str | None = None,
                          timeline: bool = True, config: str = "") -> tuple[dict, dict | None]:
    """explain's result and, from the same compile, the step's memory timeline (jaxmem.plan.timeline)."""
    label = f"compiled for {topo.label} ({'deviceless' if topo.name else 'attached devices'})"
    with tempfile.TemporaryDirectory(prefix="jaxmem-explain-") as tmp:
        where = Path(dump_dir or tmp)
        figures = compile_with_dumps(cfg, topo, where)
        out = explain_dump(cfg, where, top)
        steps = build(cfg, where, label, config) if timeline else None
    out["compiled_device_bytes"] = figures["device"]  # XLA's memory analysis of the same compile
    out["label"] = label
    if steps is not None:
        steps["compiled_device_bytes"] = figures["device"]
    return out, steps


def peak_note(live_peak: int, compiled_total: int | None) -> str:
    """Why explain's peak and plan's compiled total differ: two measures of the same compile."""
    unit = _unit(max(live_peak, compiled_total or 0))
    line = (f"peak {_fmt(live_peak, unit)} {unit[0]}: the bytes of the buffers live at once (live ranges of XLA's "
            "buffer assignment)")
    if compiled_total:
        line += (f"; `jaxmem plan` reports XLA's memory_analysis total of the same compile, "
                 f"{_fmt(compiled_total, unit)} {unit[0]} (argument + output - alias + temp: the temp allocation "
                 "counted whole, with the gaps its packing leaves)")
    return line


def render(result: dict, console=None) -> None:
    from rich.table import Table

    from rich.markup import escape

    console = console or make_wrapping_console()
    host, peak = result.get("host_live_bytes", 0), result["peak_live_bytes"]
    unit = _unit(max(peak, result.get("compiled_device_bytes") or 0))
    table = Table(title=f"device buffers live at the device peak ({_fmt(peak, unit)} {unit[0]}"
                        + (f"; {_fmt(host, unit)} {unit[0]} in pinned host memory then" if host else "")
                        + f"), {result['label']}")
    for col in ("#", "MiB", "shape", "dtype", "category", "why", "source"):
        table.add_column(col, overflow="fold", justify="right" if col in ("#", "MiB") else "left")
    for i, b in enumerate(result["buffers"], 1):
        cat = b["category"] + (f" ({b['checkpoint_name']})" if b["checkpoint_name"] else "")
        table.add_row(str(i), f"{b['bytes'] / 2**20:,.1f}", escape(str(b["shape"])), b["dtype"], escape(cat),
                      escape(b.get("why", "")), escape(b["source"]))
    console.print(table)
    console.print(peak_note(peak, result.get("compiled_device_bytes")), highlight=False)
    shown = set()
    for i, b in enumerate(result["buffers"], 1):
        if b["suggestion"] not in shown:
            shown.add(b["suggestion"])
            console.print(f"  #{i}: {escape(b['suggestion'])}", highlight=False)


# ------------------------------------------------------------------ out-of-memory in a real run


def _attached_target() -> str:
    import jax

    target = target_for_device_kind(getattr(jax.devices()[0], "device_kind", ""))
    return target.name if target else ""


def report_oom(cfg: Config, exc: BaseException, top: int = 10, file=None) -> bool:
    """If `exc` is an out-of-memory error, prints the OOM forensics for this run and returns True: bytes asked
    vs free (parsed from XLA's message), the plan's analytic bill, the levers that would free the missing
    bytes ranked by added step time (jaxmem.plan.oom), and the buffers live at the peak (explain; best
    effort). The same report goes to <out_dir>/oom_report.json.

    The explain compile runs deviceless in a subprocess for the attached GPU model, so it needs no GPU memory.
    """
    text = oom.exc_text(exc)
    if not (oom.is_oom(RuntimeError(text)) or oom.parse_oom(text).form):
        return False
    console = make_console(file or sys.stderr)
    report: dict = {"message": text[:4000]}
    topo = None
    try:
        import jax

        topo = resolve_topology(cfg, cfg.target.name or _attached_target() or None,
                                gpus_per_host=jax.local_device_count(), hosts=jax.process_count())
        report = oom.forensics(cfg, text, topo.n_devices, topo.gpu)
        oom.render(report, console)
    except Exception as e:  # the report is best effort; never mask the original error
        report["forensics_error"] = f"{type(e).__name__}: {e}"
        console.print(f"[red]out of memory[/red] (could not size it: {type(e).__name__}: {e})")
    try:
        if topo is None:
            raise RuntimeError("no topology")
        console.print("the buffers live at the peak of this step (explain):")
        result = explain(cfg, topo, top)
        render(result, console)
        report["explain"] = result
    except Exception as e:
        report["explain_error"] = f"{type(e).__name__}: {e}"
        console.print(f"(could not explain the peak: {type(e).__name__}: {e})")
    import jax

    try:
        out = Path(cfg.out_dir)
        if jax.process_index() != 0:  # one report per run
            return True
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "oom_report.json", json.dumps(report, indent=2, default=str))  # never through a link
        console.print(f"OOM report: {out / 'oom_report.json'}", highlight=False)
    except (OSError, ConfigError) as e:
        console.print(f"(could not write oom_report.json: {e})")
    return True
