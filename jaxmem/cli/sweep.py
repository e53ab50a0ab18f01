"""`jaxmem sweep SWEEP.yaml` or `jaxmem sweep CONFIG --grid key=v1,v2 ...`: plan the cross product of
overrides in worker processes, cache each plan by the hash of its resolved config and target, and write
CSV, JSON and a Pareto plot (device bytes vs estimated step time, configs that fit marked)."""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import csv
import itertools
import json
import multiprocessing
import sys
from pathlib import Path


from jaxmem.config import ConfigError, config_hash, parse_yaml_file


from jaxmem.loader import load_config
from jaxmem.plan import figure_cache
from jaxmem.runtime import cpu_host, ptxas_cache
from jaxmem.plan.report import fmt_seconds
from jaxmem.runtime.aot import add_target_args
from jaxmem.cli.help import HelpFormatter
from jaxmem import registry
from jaxmem.plan import plan, resolve_topology

MAX_WORKERS = 2  # compiles are CPU and RAM heavy; this machine has 2 cores
GIB = 1024**3


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    grid = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--grid {item!r}: expected key=v1,v2,...")
        key, values = item.split("=", 1)
        grid[key.strip()] = [v.strip() for v in values.split(",") if v.strip()]
        if not grid[key.strip()]:
            raise ConfigError(f"--grid {key}: give at least one value")
    return grid


def _read_mapping(path: Path) -> dict:
    raw = parse_yaml_file(path)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: expected a mapping (a sweep file with `config` and `grid`, or a config)")
    return raw


def read_sweep_file(path: Path) -> dict:
    """SWEEP.yaml: {config: base config (relative to this file), grid: {key: [values]}, overrides: [...],
    target: {name, gpus_per_host, hosts}, out_dir: ...}."""
    raw = _read_mapping(path)
    allowed = {"config", "grid", "overrides", "target", "out_dir"}
    for k in raw:
        if k not in allowed:
            raise ConfigError(f"{path}: {k}: unknown key; allowed keys are {', '.join(sorted(allowed))}")
    if "config" not in raw or "grid" not in raw:
        raise ConfigError(f"{path}: needs `config` and `grid`")
    if not isinstance(raw["grid"], dict) or not all(isinstance(v, list) and v for v in raw["grid"].values()):
        raise ConfigError(f"{path}: grid: must map each key to a non-empty list of values")
    raw["config"] = str((path.parent / raw["config"]).resolve()) if not Path(raw["config"]).is_absolute() \
        else raw["config"]
    raw["grid"] = {k: [str(v).lower() if isinstance(v, bool) else str(v) for v in vs] for k, vs in raw["grid"].items()}
    return raw


def points(grid: dict[str, list[str]]) -> list[list[str]]:
    keys = list(grid)
    return [[f"{k}={v}" for k, v in zip(keys, combo)] for combo in itertools.product(*(grid[k] for k in keys))]


def _plan_point(config: str, overrides: list[str], target: dict, compile: bool) -> dict:
    """Runs in a worker process."""
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return _plan_here(config, overrides, target, compile)


def _plan_here(config: str, overrides: list[str], target: dict, compile: bool) -> dict:
    cfg = load_config(config, overrides)
    topo = resolve_topology(cfg, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
    return plan(cfg, topo, compile=compile, source=config)


def run_sweep(config: str, grid: dict, base_overrides: list[str], target: dict, out_dir: Path,
              cache_dir: Path, workers: int = MAX_WORKERS, compile: bool = True) -> list[dict]:
    """Plans every grid point (cached ones are read back) and returns one row per point."""
    rows = plan_points(config, points(grid), base_overrides, target, cache_dir, workers, compile)
    mark_best(rows)
    return rows


def plan_points(config: str, point_overrides: list[list[str]], base_overrides: list[str], target: dict,
                cache_dir: Path, workers: int = MAX_WORKERS, compile: bool = True,
                names: list[str] | None = None) -> list[dict]:
    """One row per point (a list of overrides on top of `base_overrides`): each planned in a fresh worker
    process, or read back from `cache_dir` by the hash of its resolved config and target. `names`: how the
    progress lines call the points (default: their overrides)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    jobs, rows = [], []
    names = names or [" ".join(o) for o in point_overrides]
    shown = {id(o): name for o, name in zip(point_overrides, names, strict=True)}
    for overrides in point_overrides:
        cfg = load_config(config, base_overrides + overrides)  # every point validated before any compile
        topo = resolve_topology(cfg, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
        key = config_hash(cfg, f"{topo.label}|compile={compile}")
        jobs.append((overrides, key, cache_dir / f"{key}.json"))
    todo = [j for j in jobs if not j[2].is_file()]
    results: dict[str, dict] = {}

    def record(o, key, path, get) -> None:
        try:
            results[key] = get()
            path.write_text(json.dumps(results[key]))  # only successful plans are cached
        except Exception as e:  # one failing point must not lose the others
            results[key] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"}
        print(f"{'FAILED ' if 'error' in results[key] else 'planned'} {shown[id(o)]}", flush=True)

    with figure_cache.defaulted_to(cache_dir / "figures"):  # points share the init compile (same state layout)
        if todo and workers <= 0:  # in this process, one point after another (debugging, tests)
            for o, key, path in todo:
                record(o, key, path, lambda o=o: _plan_here(config, base_overrides + o, target, compile))
        elif todo:
            ctx = multiprocessing.get_context("spawn")
            # A fresh process per point: compiles with host memory placement misbehave after other compiles in
            # the same process (seen with the pinned-host shim), and a point's peak RAM is returned to the system.
            # The points' deviceless compiles share ptxas's cubins of the kernels they have in common.
            with ptxas_cache.defaulted_to(cache_dir / "ptxas"), futures.ProcessPoolExecutor(
                    max_workers=max(1, min(workers, MAX_WORKERS)), mp_context=ctx, max_tasks_per_child=1,
                    initializer=cpu_host.start_jax_quietly) as pool:  # before the point's module imports jax
                running = {pool.submit(_plan_point, config, base_overrides + o, target, compile): (o, k, p)
                           for o, k, p in todo}
                for fut in futures.as_completed(running):
                    o, key, path = running[fut]
                    record(o, key, path, fut.result)
    for overrides, key, path in jobs:
        cached = key not in results
        rows.append(_row(overrides, key, json.loads(path.read_text()) if cached else results[key], cached))
    return rows


def failed(row: dict) -> bool:
    return row.get("status") == "failed" or bool(row.get("error"))


def best_point(rows: list[dict]) -> dict | None:
    """The best planned point under the budget: fits first (a point that fits beats one whose capacity is
    unknown; one that does not fit is never best), then the lowest estimated step time, ties broken by more
    headroom (fewer device bytes)."""
    ok = [r for r in rows if not failed(r) and r["fits"] is not False]
    if not ok:
        return None
    return min(ok, key=lambda r: (r["fits"] is not True, r["step_seconds_estimated"], r["device_bytes"]))


def mark_best(rows: list[dict]) -> dict | None:
    best = best_point(rows)
    for r in rows:
        r["best"] = r is best
    return best


def _row(overrides: list[str], key: str, p: dict, cached: bool) -> dict:
    row = {"point": " ".join(overrides), "hash": key, "cached": cached}
    row.update({o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides})
    if "error" in p:
        return {**row, "status": "failed", "error": p["error"]}
    compiled = p.get("compiled")
    row.update({"status": "planned", "error": None})
    row.update({
        # what the run needs: the step's total, or its init's where larger (a plan cached before it had none)
        "device_bytes": p.get("device_need_bytes") or (compiled["device_total"] if compiled
                                                       else p["analytic"]["device_total"]),
        "device_bytes_basis": p["fits_basis"],
        "analytic_device_bytes": p["analytic"]["device_total"],
        "host_bytes": compiled["host_total"] if compiled else p["analytic"]["host_total"],
        "fits": p["fits"], "host_fits": p["host_fits"],
        "step_seconds_estimated": p["cost"]["step_seconds"], "mfu_estimated": p["cost"]["mfu"],
        "tokens_per_step": p["cost"]["tokens_per_step"],
        "warnings": len(p["warnings"]), "target": p["target"]["name"], "devices": p["devices"],
        "usable_device_bytes": p["usable_device_bytes"],
        "peak_phase": p.get("peak_phase"),  # a run of several programs (GRPO): the phase that sets its peak
    })
    return row


def write_outputs(rows: list[dict], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "sweep.json", "csv": out_dir / "sweep.csv", "png": out_dir / "pareto.png"}
    paths["json"].write_text(json.dumps(rows, indent=2))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with paths["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    plot_pareto(rows, paths["png"])
    return paths


def pareto_front(rows: list[dict]) -> list[dict]:
    """Points no other point beats on both device bytes and estimated step time."""
    ok = [r for r in rows if not failed(r)]
    return [r for r in ok if not any(o["device_bytes"] <= r["device_bytes"] and o["step_seconds_estimated"]
                                     <= r["step_seconds_estimated"] and (o["device_bytes"], o["step_seconds_estimated"])
                                     != (r["device_bytes"], r["step_seconds_estimated"]) for o in ok)]


def _short_label(row: dict) -> str:
    """A point's swept values without the dotted prefixes ("preset=full mb=2"), for plot labels."""
    return " ".join(f"{o.split('=', 1)[0].rsplit('.', 1)[-1]}={o.split('=', 1)[1]}" if "=" in o else o
                    for o in row["point"].split())


def plot_pareto(rows: list[dict], path: Path) -> None:
    """Device bytes vs estimated step time of the planned points (failed points are left out), the best point
    under the budget starred, the Pareto front dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not failed(r)]
    bunit, bscale = byte_unit(ok)
    biggest = max([r["device_bytes"] for r in ok] + [0])
    slowest = max([r["step_seconds_estimated"] for r in ok] + [0.0])
    tunit, tscale = ("s", 1.0) if slowest >= 1 else ("ms", 1e-3) if slowest >= 1e-3 else ("us", 1e-6)
    x = lambda r: r["device_bytes"] / bscale  # noqa: E731
    y = lambda r: r["step_seconds_estimated"] / tscale  # noqa: E731
    fig, ax = plt.subplots(figsize=(9, 6))
    for fits, style in ((True, dict(marker="o", color="tab:green", label="fits")),
                        (False, dict(marker="x", color="tab:red", label="does not fit")),
                        (None, dict(marker="s", color="0.5", label="no capacity known"))):
        sel = [r for r in ok if r["fits"] is fits]
        if sel:
            ax.scatter([x(r) for r in sel], [y(r) for r in sel], s=40, zorder=3, **style)
    front = sorted(pareto_front(ok), key=lambda r: r["device_bytes"])
    if front:
        ax.plot([x(r) for r in front], [y(r) for r in front], "k--", linewidth=0.8, label="Pareto front")
    usable = sorted({r["usable_device_bytes"] for r in ok if r.get("usable_device_bytes")})
    for i, u in enumerate(usable):
        if u <= 3 * biggest:  # a capacity far right of every point would squash them against the axis
            ax.axvline(u / bscale, color="red", linestyle=":", linewidth=1,
                       label="usable capacity (after headroom)" if i == 0 else None)
        elif i == 0:
            ax.plot([], [], " ", label=f"usable capacity {u / GIB:.1f} GiB (off the chart)")
    best = best_point(ok)
    if best is not None:
        ax.scatter([x(best)], [y(best)], marker="*", s=320, facecolors="none", edgecolors="black", linewidths=1.3,
                   zorder=4, label=f"best under budget: {_short_label(best)}")
    for i, r in enumerate(ok):
        ax.annotate(_short_label(r), (x(r), y(r)), xytext=(6, 4 if i % 2 == 0 else -10), textcoords="offset points",
                    fontsize=8, fontweight="bold" if r is best else "normal")
    basis = ok[0]["device_bytes_basis"] if ok else "analytic"
    where = f"compiled for {ok[0]['devices']} x {ok[0]['target']} (deviceless)" if basis == "compiled" and ok \
        else "estimated (analytic)"
    ax.set_xlabel(f"device memory per GPU ({bunit}), {where}")
    ax.set_ylabel(f"step time ({tunit}), estimated (cost model)")
    n_failed = len(rows) - len(ok)
    title = (f"sweep on {ok[0]['devices']} x {ok[0]['target']}: memory vs estimated step time" if ok
             else "sweep: no point planned")
    ax.set_title(title + (f"\n{n_failed} of {len(rows)} points failed (not shown)" if n_failed else ""), fontsize=10)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    if ok:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def byte_unit(rows: list[dict]) -> tuple[str, int]:
    """One unit for every planned point: GiB, or MiB when some point is under a GiB (GiB would round it)."""
    sizes = [r["device_bytes"] for r in rows if not failed(r)]
    return ("GiB", GIB) if sizes and min(sizes) >= GIB else ("MiB", 1024**2)


def format_row(r: dict, unit: tuple[str, int] | None = None) -> str:
    """One table line: the figures with enough digits to tell points apart."""
    if failed(r):
        return "FAILED"
    name, scale = unit or byte_unit([r])
    fits = {True: "fits", False: "does not fit", None: "capacity unknown"}[r["fits"]]
    return (f"{r['device_bytes'] / scale:>12,.2f} {name} ({r['device_bytes_basis']}), {fits}, "
            f"step {fmt_seconds(r['step_seconds_estimated'])} (estimated)"
            f"{'  <- best' if r.get('best') else ''}{' [cached]' if r['cached'] else ''}")


def print_summary(rows: list[dict]) -> None:
    width = max([len(r["point"]) for r in rows] + [20])
    unit = byte_unit(rows)
    for r in rows:
        print(f"{r['point']:{width}s} {format_row(r, unit)}")
    bad = [r for r in rows if failed(r)]
    if bad:
        print(f"{len(bad)} of {len(rows)} points failed; first error: {bad[0]['error']}")
    best = next((r for r in rows if r.get("best")), None)
    if best is not None:
        print(f"best under the budget (fits, then lowest estimated step time, then most headroom): {best['point']}")
    elif len(bad) < len(rows):
        print("best under the budget: none (no planned point fits)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="jaxmem sweep", formatter_class=HelpFormatter,
        description="Plan the cross product of config overrides, each point in its own worker process, cache "
                    "each plan by the hash of its resolved config and target, and write CSV, JSON and a Pareto "
                    "plot (device bytes vs estimated step time, the configs that fit marked). The grid comes "
                    "from a SWEEP.yaml (keys config, grid and optionally overrides, target, out_dir) or from "
                    "--grid flags on a config YAML.",
        epilog="examples:\n"
               "  jaxmem sweep configs/sweeps/llama3-8b-remat-8xh100.yaml\n"
               "  jaxmem sweep configs/llama3-8b-8xh100.yaml --grid remat.preset=full,selective,none "
               "--grid train.micro_batch=1,2\n"
               "  jaxmem sweep configs/tiny.yaml --grid remat.preset=none,full --no-compile --out runs/sweeps/t\n"
               "  jaxmem sweep configs/moe/qwen3-30b-a3b-8xh100.yaml --grid parallel.ep=auto   # ep values that "
               "divide experts and devices, where validate accepts them")
    ap.add_argument("source", help="a SWEEP.yaml (with `config` and `grid`) or a config YAML with --grid")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to every point")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (repeatable)")
    add_target_args(ap)
    ap.add_argument("--out", default=None, help="output folder (default: runs/sweeps/<name>)")
    ap.add_argument("--cache", default=None, help="plan cache folder (default: <out>/cache)")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS,
                    help=f"worker processes; 0: plan in this process (default: {MAX_WORKERS})")
    ap.add_argument("--no-compile", action="store_true", help="analytic bills only")
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    src = Path(args.source)
    if not src.is_file():
        raise ConfigError(f"{src}: file not found")
    raw = _read_mapping(src)
    if "grid" in raw:
        spec = read_sweep_file(src)
        config, grid = spec["config"], spec["grid"]
        grid.update(parse_grid(args.grid))
        base = list(spec.get("overrides", [])) + args.overrides
        target = dict(spec.get("target") or {})
        out = Path(args.out or spec.get("out_dir") or f"runs/sweeps/{src.stem}")
    else:
        config, grid, base, target = str(src), parse_grid(args.grid), args.overrides, {}
        if not grid:
            raise ConfigError("sweep: give --grid key=v1,v2 (or a SWEEP.yaml with a grid)")
        out = Path(args.out or f"runs/sweeps/{src.stem}")
    for flag, key in ((args.target, "name"), (args.gpus_per_host, "gpus_per_host"), (args.hosts, "hosts")):
        if flag is not None:
            target[key] = flag
    cache = Path(args.cache) if args.cache else out / "cache"
    if any(values == ["auto"] for values in grid.values()):  # a feature's values the model and devices allow
        cfg = load_config(config, base)
        topo = resolve_topology(cfg, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
        for feature in registry.FEATURES:  # a mixture of experts: parallel.ep=auto
            grid = feature.expand_grid(grid, lambda o: load_config(config, base + o), cfg, topo.n_devices)
    checked = load_config(config, base)
    registry.for_config(checked).refuse_unsupported(checked, "sweep")
    rows = run_sweep(config, grid, base, target, out, cache, args.workers, not args.no_compile)
    paths = write_outputs(rows, out)
    print_summary(rows)
    print(f"wrote {paths['csv']}, {paths['json']}, {paths['png']}")
    return 1 if rows and all(failed(r) for r in rows) else 0
