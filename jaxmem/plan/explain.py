"""`jaxmem explain CONFIG [--target T] [--top N] [--json FILE]`: the buffers live at the memory peak of
the compiled train step, each with its category, the jaxmem source line that created it, and a fix.
`--html/--plot/--timeline-json [--compare OTHER.yaml]`: the step's memory timeline (jaxmem.plan.timeline).

Also `report_oom(cfg, exc)`, for the training loop: explain an out-of-memory instead of XLA's raw text.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxmem.runtime.aot import Topology, add_target_args, resolve_topology
from jaxmem.config import Config, ConfigError, from_dict, load_config, to_dict
from jaxmem.plan import hlo_dump
from jaxmem.plan.buffer_kinds import classify, state_shapes


# ------------------------------------------------------------------ compiling with dumps


def _worker(cfg_json: str, topo_json: str) -> None:
    """Runs in a fresh process whose XLA_FLAGS ask for dumps: compile only."""
    from jaxmem.plan.compiled import memory_figures
    from jaxmem.core.program import build_program

    cfg = from_dict(json.loads(cfg_json))
    topo = Topology(**json.loads(topo_json))
    compiled = build_program(cfg, devices=list(topo.devices())).lower().compile()
    print(json.dumps(memory_figures(compiled)))


def compile_with_dumps(cfg: Config, topo: Topology, dump_dir: Path) -> dict:
    """Compiles in a fresh process whose XLA_FLAGS ask for dumps into `dump_dir`; returns the compile's
    memory figures (jaxmem.plan.compiled.memory_figures)."""
    flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_step"
    env = dict(os.environ, JAX_PLATFORMS="cpu" if topo.name else os.environ.get("JAX_PLATFORMS", ""),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
    topo_json = json.dumps({k: getattr(topo, k) for k in ("name", "gpus_per_host", "hosts", "headroom",
                                                         "host_ram_bytes")})
    code = "import sys; from jaxmem.plan.explain import _worker; _worker(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(to_dict(cfg)), topo_json], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"explain: the dump compile failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    from jaxmem.plan.timeline import build

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


def render(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    from rich.markup import escape

    console = console or Console()
    host = result.get("host_live_bytes", 0)
    table = Table(title=f"device buffers live at the device peak ({result['peak_live_bytes'] / 2**30:.2f} GiB"
                        + (f"; {host / 2**30:.2f} GiB in pinned host memory then" if host else "")
                        + f"), {result['label']}")
    for col in ("#", "MiB", "shape", "dtype", "category", "why", "source"):
        table.add_column(col, overflow="fold", justify="right" if col in ("#", "MiB") else "left")
    for i, b in enumerate(result["buffers"], 1):
        cat = b["category"] + (f" ({b['checkpoint_name']})" if b["checkpoint_name"] else "")
        table.add_row(str(i), f"{b['bytes'] / 2**20:,.1f}", escape(str(b["shape"])), b["dtype"], escape(cat),
                      escape(b.get("why", "")), escape(b["source"]))
    console.print(table)
    shown = set()
    for i, b in enumerate(result["buffers"], 1):
        if b["suggestion"] not in shown:
            shown.add(b["suggestion"])
            console.print(f"  #{i}: {escape(b['suggestion'])}", highlight=False)


# ------------------------------------------------------------------ out-of-memory in a real run


def _attached_target() -> str:
    import jax

    from jaxmem.config.targets import target_for_device_kind

    target = target_for_device_kind(getattr(jax.devices()[0], "device_kind", ""))
    return target.name if target else ""


def report_oom(cfg: Config, exc: BaseException, top: int = 10, file=None) -> bool:
    """If `exc` is an out-of-memory error, prints the OOM forensics for this run and returns True: bytes asked
    vs free (parsed from XLA's message), the plan's analytic bill, the levers that would free the missing
    bytes ranked by added step time (jaxmem.plan.oom), and the buffers live at the peak (explain; best
    effort). The same report goes to <out_dir>/oom_report.json.

    The explain compile runs deviceless in a subprocess for the attached GPU model, so it needs no GPU memory.
    """
    from jaxmem.plan import oom

    text = oom.exc_text(exc)
    if not (oom.is_oom(RuntimeError(text)) or oom.parse_oom(text).form):
        return False
    from rich.console import Console

    console = Console(file=file or sys.stderr, width=160)
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
        (out / "oom_report.json").write_text(json.dumps(report, indent=2, default=str))
        console.print(f"OOM report: {out / 'oom_report.json'}", highlight=False)
    except OSError as e:
        console.print(f"(could not write oom_report.json: {e})")
    return True


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    from jaxmem.cli.config_cmd import HelpFormatter

    ap = argparse.ArgumentParser(
        prog="jaxmem explain", formatter_class=HelpFormatter,
        description="The buffers live at the memory peak of the compiled train step, biggest first, each with "
                    "its category, the jaxmem source line that created it and the config change that shrinks "
                    "it. Compiles once more with XLA dumps in a subprocess (deviceless for a named target).",
        epilog="examples:\n"
               "  jaxmem explain configs/llama3-8b-8xh100.yaml --top 10 --json explain.json\n"
               "  jaxmem explain configs/llama3-8b-8xh100.yaml remat.preset=full --target h200-141g\n"
               "  jaxmem explain configs/tiny.yaml --dump-dir /tmp/dump    # attached devices; keep the dumps\n"
               "  jaxmem explain configs/ladder/3-kernels.yaml --compare configs/ladder/4-remat.yaml --html t.html\n"
               "  jaxmem explain configs/tiny.yaml --compare configs/tiny.yaml --compare-set remat.preset=full "
               "--plot t.png")
    ap.add_argument("config", help="a config YAML file")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    add_target_args(ap)
    ap.add_argument("--top", type=int, default=10, help="how many of the biggest buffers to show (default: 10)")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the result as JSON")
    ap.add_argument("--dump-dir", default=None, help="keep XLA's dump files here")
    timeline = ap.add_argument_group("memory timeline (docs/explain.md)")
    timeline.add_argument("--html", default=None, metavar="FILE",
                          help="write the step's memory timeline as one self-contained HTML page")
    timeline.add_argument("--plot", default=None, metavar="FILE", help="write the timeline as a PNG (matplotlib)")
    timeline.add_argument("--timeline-json", default=None, metavar="FILE",
                          help="write the timeline's data as JSON (docs/plan_schema.md)")
    timeline.add_argument("--compare", default=None, metavar="OTHER.yaml",
                          help="draw a second config's timeline next to this one (same target and overrides)")
    timeline.add_argument("--compare-set", action="append", default=[], metavar="KEY=VALUE",
                          help="an override for the --compare config only (repeatable)")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.top < 1:
        raise ConfigError(f"--top: must be >= 1, got {args.top}")
    wants_timeline = bool(args.html or args.plot or args.timeline_json)
    if (args.compare or args.compare_set) and not wants_timeline:
        raise ConfigError("--compare: draws a second timeline; give --html, --plot or --timeline-json too")
    if args.compare_set and not args.compare:
        raise ConfigError("--compare-set: give --compare OTHER.yaml (it may be the same file)")
    if args.compare and not Path(args.compare).is_file():
        raise ConfigError(f"--compare {args.compare}: config file not found")
    jobs = [(args.config, load_config(args.config, args.overrides), args.overrides)]
    if args.compare:
        extra = [*args.overrides, *args.compare_set]
        jobs.append((args.compare, load_config(args.compare, extra), extra))
    topos = [resolve_topology(cfg, args.target, args.gpus_per_host, args.hosts) for _, cfg, _ in jobs]
    results, timelines = [], []
    for (path, cfg, overrides), topo in zip(jobs, topos):
        name = " ".join([path, *overrides])
        result, steps = explain_with_timeline(cfg, topo, args.top, args.dump_dir if len(jobs) == 1 else None,
                                              timeline=wants_timeline, config=name)
        if len(jobs) > 1:
            print(name)
        render(result)
        results.append(result)
        timelines.append(steps)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results[0], indent=2))
    write_timeline(timelines, args.html, args.plot, args.timeline_json)
    return 0


def write_timeline(timelines: list[dict], html: str | None, plot: str | None, json_path: str | None) -> None:
    """Writes the page, the PNG and the JSON that were asked for (one timeline, or a list of two)."""
    if html:
        from jaxmem.plan.timeline_html import write

        print(f"timeline page: {write(html, timelines)}")
    if plot:
        from jaxmem.plan.timeline_plot import plot_timelines

        print(f"timeline plot: {plot_timelines(timelines, plot)}")
    if json_path:
        Path(json_path).write_text(json.dumps(timelines[0] if len(timelines) == 1 else timelines))
        print(f"timeline data: {json_path}")
