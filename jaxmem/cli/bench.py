"""`jaxmem bench CONFIG [key=value ...] [--steps N] [--warmup W] [--json F]`: the plan next to a measurement.

On the devices attached to this process, bench compiles the config's train step (XLA's memory analysis of
that executable is the planned figure), inits the state, runs N steps on the config's data and reports,
side by side: planned device bytes vs the allocator's measured peak, the cost model's step time vs the
measured median, tokens/s and MFU. Every figure carries a label saying how it was obtained. Nothing is
written to disk but the --json file (and the --html page): no checkpoints, no metrics, nothing in out_dir.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

from jaxmem.plan.oom import is_oom
from jaxmem.config.targets import target_for_device_kind
from jaxmem.io.data import batches
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.compiled import CompiledFigures
from jaxmem.runtime.compiled_memory import captured_stderr, memory_warnings, read_fields
from jaxmem.plan.costmodel import estimate
from jaxmem.plan.report import cost_assumptions
from jaxmem.registry import build_program
from jaxmem.config.schema import config_hash
from jaxmem.train.loop import _oom_error, compile_train_step
from jaxmem.plan.report import _fmt, _unit, fmt_seconds
from jaxmem.cli.help import HelpFormatter
from jaxmem.plan.timeline_html import measured_from_rows, write
from jaxmem.runtime import cpu_host, distributed
from jaxmem.loader import load_config
from jaxmem.config.schema import ConfigError
from jaxmem.train import TrainError
from jaxmem.plan import allocator
from jaxmem.io.console import make_console

SCHEMA_VERSION = 1
_STATS_HOW = "max over this process's devices of Device.memory_stats()"
MFU_FORMULA = ("MFU = model FLOPs per step / (median step time x devices x peak FLOP/s per device for "
               "precision.compute_dtype); model FLOPs = 6 x matmul params x tokens + causal attention (3 x 4 x "
               "tokens x seq_len x heads x head_dim per layer, counted unmasked), the cost model's model_flops")


def _fig(value, label: str, how: str, **extra) -> dict:
    return {"value": value, "label": label, "how": how, **extra}


def _allocator(devices) -> dict | None:
    """max over `devices` of Device.memory_stats()' bytes_in_use and peak_bytes_in_use; None where a device
    has no statistics (the CPU backend)."""
    stats = [d.memory_stats() for d in devices]
    if not stats or any(not s or "bytes_in_use" not in s for s in stats):
        return None
    return {k: max(int(s.get(k, 0)) for s in stats) for k in ("bytes_in_use", "peak_bytes_in_use")}


def _shard_bytes(tree, device) -> int:
    return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards if s.device == device)


def _ratio(a, b):
    return a / b if a is not None and b else None


def bench(cfg, steps: int = 10, warmup: int = 3, source: str = "", overrides: tuple[str, ...] = ()) -> dict:
    """Compiles, inits and runs `steps` train steps of `cfg` on the attached devices; the bench dict."""
    prog = build_program(cfg)
    n = prog.mesh.size
    local = [d for d in prog.mesh.devices.flat if d.process_index == jax.process_index()]
    kind, platform = local[0].device_kind, local[0].platform
    gpu = target_for_device_kind(kind) if platform == "gpu" else None
    bill = compute_bill(cfg, n, gpu=platform == "gpu", layout=prog.layout)
    cost = estimate(cfg, bill, gpu, n, prog.grad_accum, prog.rows)
    data = batches(cfg, prog)
    batch = next(data)  # bad data fails here, before the compile
    start = time.perf_counter()
    with captured_stderr() as lines:
        compiled = compile_train_step(prog)
    figures = CompiledFigures(read_fields(compiled), memory_warnings(lines), time.perf_counter() - start,
                              f"compiled on this machine for {kind}", jax.__version__)
    measured = f"measured on {platform.upper()}"
    na = f"not available on {platform}"
    after_init, state_counted, times, losses, per_step = _run(prog, compiled, batch, data, steps, local)
    after_steps = _allocator(local)
    median = statistics.median(times[warmup:])
    peak_flops = gpu.peak_flops(cfg.precision.compute_dtype) if gpu else None
    mfu = cost.model_flops / (median * n * peak_flops) if peak_flops else None
    estimated = cost.step_seconds if gpu and cost.step_seconds else None
    stats_how = _STATS_HOW
    no_target = (f"no GPU target for {kind!r} (`jaxmem list targets`)" if platform == "gpu"
                 else f"no GPU target on {platform}")
    return {
        "schema_version": SCHEMA_VERSION,
        "config": source,
        "overrides": list(overrides),
        "config_hash": config_hash(cfg, f"{n} x {kind}"),
        "model": cfg.model.preset,
        "params": int(cost.params),
        "device": {"kind": kind, "platform": platform, "devices": n, "target": gpu.name if gpu else None,
                   "peak_flops_per_device": peak_flops,
                   "peak_how": (f"{gpu.name} dense peak for {cfg.precision.compute_dtype} ({gpu.source})" if gpu
                                else f"no published peak: {no_target}")},
        "mesh": dict(bill.mesh),
        "steps": steps,
        "warmup": warmup,
        "compiled": figures.to_json(),
        "cost": cost.to_json(),
        "memory": _memory(figures, after_init, state_counted, after_steps, measured, na),
        "step_time": {
            "measured_seconds": _fig(median, measured, f"median of {steps - warmup} step(s) after {warmup} "
                                     "warm-up step(s), each timed to jax.block_until_ready",
                                     all_steps=[float(t) for t in times]),
            "estimated_seconds": _fig(estimated, cost_assumptions(cost.to_json()), "cost model step_seconds",
                                      **({} if estimated else {"note": f"n/a: {no_target}"})),
            "measured_over_estimated": _fig(_ratio(median if estimated else None, estimated), measured,
                                            "measured_seconds / estimated_seconds"),
        },
        "tokens_per_step": _fig(int(cost.tokens_per_step), "counted from the config",
                                "grad_accum x global rows x seq_len"),
        "tokens_per_second": _fig(cost.tokens_per_step / median, measured, "tokens_per_step / measured median step"),
        "mfu": _fig(mfu, measured, MFU_FORMULA, model_flops_per_step=float(cost.model_flops),
                    **({} if mfu is not None else {"note": f"n/a: {no_target}"})),
        "losses": _fig(losses, measured, "the step's loss at every step, warm-up included"),
        "memory_per_step": _fig([{"step": i + 1, **{f"mem/{k}": v for k, v in (s or {}).items()}}
                                 for i, s in enumerate(per_step)], measured,
                                f"after each step: {stats_how} (jaxmem.train.telemetry's metrics keys)",
                                **({} if after_steps else {"note": na})),
        "warnings": list(figures.warnings),
    }


def _run(prog, compiled, batch, data, steps: int, local: list):
    """Inits the state and runs `steps` timed steps: (allocator after init, the state's counted bytes, the step
    times, the losses, the allocator after each step)."""
    try:
        state = jax.block_until_ready(prog.init_state())
        after_init = _allocator(local)
        state_counted = _shard_bytes(state, local[0])
        times, losses, per_step = [], [], []
        for i in range(steps):
            batch = batch if i == 0 else next(data)  # built on the host before the clock starts
            t0 = time.perf_counter()
            state, metrics = jax.block_until_ready(compiled(state, batch))
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
            per_step.append(_allocator(local))  # after the clock stops: --html draws it
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            raise _oom_error("running", e) from None
        raise
    return after_init, state_counted, times, losses, per_step


def _memory(figures, after_init, state_counted, after_steps, measured: str, na: str) -> dict:
    """The bench's memory section: planned (compiled) next to measured, each saying how it was obtained."""
    planned, peak = figures.device_total, after_steps and after_steps["peak_bytes_in_use"]
    stats_how = _STATS_HOW
    return {
        "planned_device_bytes": _fig(planned, figures.label, "argument + output - alias + temp of XLA's "
                                     "memory_analysis() of the executable that ran, per device"),
        "planned_host_bytes": _fig(figures.host_total, figures.label, "host_argument + host_output - "
                                   "host_alias + host_temp, per device"),
        "state_bytes_after_init": _fig(after_init and after_init["bytes_in_use"], measured,
                                       f"bytes_in_use after init_state: {stats_how}",
                                       **({} if after_init else {"note": na})),
        "state_bytes_counted": _fig(state_counted, "counted from the state's arrays (not an allocator reading)",
                                    "bytes of the state's shards on the first device"),
        "measured_peak_bytes": _fig(peak, measured, f"peak_bytes_in_use after the steps (the allocator's peak "
                                    f"since the process started: compile and init included): {stats_how}",
                                    **({} if after_steps else {"note": na})),
        "peak_bytes_after_init": _fig(after_init and after_init["peak_bytes_in_use"], measured,
                                      f"peak_bytes_in_use after init_state, before the first step: {stats_how}; "
                                      "where it equals measured_peak_bytes the run's peak was the init's",
                                      **({} if after_init else {"note": na})),
        "peak_over_planned": _fig(_ratio(peak, planned), measured, "measured_peak_bytes / planned_device_bytes"),
    }


def render(r: dict, console=None) -> None:
    """Prints the bench dict: planned/estimated next to measured, then how each figure was obtained."""
    from rich.table import Table

    console = console or make_console()
    mem, st, mfu, d, c = r["memory"], r["step_time"], r["mfu"], r["device"], r["compiled"]
    unit = _unit(max(v for v in (mem["planned_device_bytes"]["value"], mem["measured_peak_bytes"]["value"]) if v))
    na = lambda f, text: text if f["value"] is None else f"{f['value']:.3f}"  # noqa: E731
    size = lambda f: f.get("note") or f"{_fmt(f['value'], unit)} {unit[0]}"  # noqa: E731
    secs = lambda f: "n/a" if f["value"] is None else fmt_seconds(f["value"])  # noqa: E731
    measured = mem["measured_peak_bytes"]["label"]
    table = Table(title=f"{r['config'] or r['model']}: {r['params']:,} params, {d['devices']} x {d['kind']}, "
                        f"mesh {r['mesh']}", caption=f"{r['steps']} steps, {r['warmup']} warm-up, per device")
    for col in ("figure", "planned", "how planned", measured, "meas./plan"):
        table.add_column(col, justify="right" if col in ("planned", measured, "meas./plan") else "left")
    table.add_row("device bytes (peak)", size(mem["planned_device_bytes"]), "compiled",
                  size(mem["measured_peak_bytes"]), na(mem["peak_over_planned"], "n/a"))
    table.add_row("state bytes after init", size(mem["state_bytes_counted"]), "counted",
                  size(mem["state_bytes_after_init"]), "")
    table.add_row("peak by the end of init", "", "", size(mem["peak_bytes_after_init"]), "")
    table.add_row("step time (median)", secs(st["estimated_seconds"]), "cost model", secs(st["measured_seconds"]),
                  na(st["measured_over_estimated"], "n/a"))
    table.add_row("tokens/s", "", "", f"{r['tokens_per_second']['value']:,.0f}", "")
    table.add_row("MFU", f"{r['cost']['mfu']:.1%}" if st["estimated_seconds"]["value"] else "n/a", "cost model",
                  "n/a" if mfu["value"] is None else f"{mfu['value']:.1%}", "")
    console.print(table)
    lines = [f"compiled: {c['label']} in {c['compile_seconds']:.1f} s (XLA memory_analysis: argument + output - "
             f"alias + temp); host bytes {size(mem['planned_host_bytes'])}",
             f"counted: {mem['state_bytes_counted']['how']}",
             f"cost model: {st['estimated_seconds']['label']}" + (f"; {st['estimated_seconds']['note']}"
                                                                  if st["estimated_seconds"].get("note") else ""),
             f"{measured}: memory from Device.memory_stats() (peak_bytes_in_use after the steps, bytes_in_use after "
             f"init); step time = {st['measured_seconds']['how']}",
             f"{MFU_FORMULA}; model FLOPs/step {mfu['model_flops_per_step']:.3e}, "
             f"{r['tokens_per_step']['value']:,} tokens/step; peak: {d['peak_how']}",
             "losses: " + " ".join(f"{x:.4f}" for x in r["losses"]["value"])]
    for line in lines + [f"warning: {w}" for w in r["warnings"]]:
        console.print(line, highlight=False, markup=False)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="jaxmem bench", formatter_class=HelpFormatter,
        usage="jaxmem bench CONFIG [key=value ...] [--steps N] [--warmup W] [--json FILE] [--html FILE]",
        description="Run a config's train step on the devices attached to this process and put the plan next to "
                    "the measurement: XLA's compiled device bytes vs the allocator's peak (Device.memory_stats(), "
                    "GPU only), the cost model's step time vs the measured median, tokens/s and MFU (GPU with a "
                    "known target only). Writes nothing but --json and --html: no checkpoints, nothing in out_dir.",
        epilog="examples:\n"
               "  jaxmem bench configs/tiny.yaml --steps 3            # on CPU: times and losses, no memory stats\n"
               "  jaxmem bench configs/llama3-8b-1xh100-128k.yaml train.seq_len=8192 --json bench.json\n"
               "guide: docs/bench.md; config keys: docs/config.md")
    ap.add_argument("items", nargs="+", metavar="CONFIG [key=value ...]",
                    help="a config YAML file, then dotted key=value overrides")
    ap.add_argument("--steps", type=int, metavar="N", default=10, help="steps to run, warm-up included (default 10)")
    ap.add_argument("--warmup", type=int, metavar="W", default=None,
                    help="first steps left out of the timing (default 3, at most --steps - 1)")
    ap.add_argument("--json", dest="json_path", metavar="FILE", default=None, help="write the results as JSON")
    ap.add_argument("--html", metavar="FILE", default=None,
                    help="write a page with the measured device memory of every step next to the planned peak")
    return ap.parse_intermixed_args(argv)


def write_html(result: dict, path: str) -> Path:
    """The measured per-step device memory next to the compiled (planned) device bytes, as one HTML page."""
    mem = result["memory"]
    rows = result["memory_per_step"]
    source = f"{rows['label']}, {rows['how']}" + (f" ({rows['note']})" if rows.get("note") else "")
    measured = measured_from_rows(rows["value"], mem["planned_device_bytes"]["value"], source,
                                  f"{mem['planned_device_bytes']['label']}: {mem['planned_device_bytes']['how']}")
    d = result["device"]
    return write(path, [], f"jaxmem bench {result['config'] or result['model']}: {d['devices']} x {d['kind']}",
                 measured)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.warmup is None:
        args.warmup = max(0, min(3, args.steps - 1))
    problem = ("--steps must be >= 1" if args.steps < 1 else "--warmup must be >= 0" if args.warmup < 0
               else "--warmup must be < --steps (the median needs a timed step)" if args.warmup >= args.steps else "")
    if problem:
        print(f"jaxmem bench: {problem} (got --steps {args.steps} --warmup {args.warmup})", file=sys.stderr)
        return 2
    path, overrides = args.items[0], args.items[1:]
    if "=" in path:
        raise ConfigError(f"{path}: give the config file first, then key=value overrides")
    if not Path(path).is_file():
        raise ConfigError(f"{path}: config file not found")
    cfg = load_config(path, overrides)
    # a CPU host gets the devices the mesh takes (before the backend starts; docs/config.md, parallel)
    cpu_host.give_mesh_its_devices(cfg.parallel, distributed.expected_processes(cfg.distributed))
    allocator.prepare(cfg, "bench")  # before the backend starts
    distributed.initialize(cfg.distributed)
    try:
        result = bench(cfg, args.steps, args.warmup, source=path, overrides=tuple(overrides))
    except TrainError as e:
        print(f"jaxmem bench: {e}", file=sys.stderr)
        return 1
    if jax.process_index() == 0:
        render(result)
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result, indent=2))
        if args.html:
            print(f"memory page: {write_html(result, args.html)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
