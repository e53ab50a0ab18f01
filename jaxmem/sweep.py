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


from jaxmem.config import ConfigError, config_hash, load_config, parse_yaml_file

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
    from jaxmem.plan import plan, resolve_topology

    cfg = load_config(config, overrides)
    topo = resolve_topology(cfg, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
    return plan(cfg, topo, compile=compile, source=config)


def run_sweep(config: str, grid: dict, base_overrides: list[str], target: dict, out_dir: Path,
              cache_dir: Path, workers: int = MAX_WORKERS, compile: bool = True) -> list[dict]:
    """Plans every grid point (cached ones are read back) and returns one row per point."""
    from jaxmem.plan import resolve_topology

    cache_dir.mkdir(parents=True, exist_ok=True)
    jobs, rows = [], []
    for overrides in points(grid):
        cfg = load_config(config, base_overrides + overrides)  # every point validated before any compile
        topo = resolve_topology(cfg, target.get("name"), target.get("gpus_per_host"), target.get("hosts"))
        key = config_hash(cfg, f"{topo.label}|compile={compile}")
        jobs.append((overrides, key, cache_dir / f"{key}.json"))
    todo = [j for j in jobs if not j[2].is_file()]
    results: dict[str, dict] = {}
    if todo:
        ctx = multiprocessing.get_context("spawn")
        # A fresh process per point: compiles with host memory placement misbehave after other compiles in the
        # same process (seen with the pinned-host shim), and a point's peak RAM is returned to the system.
        with futures.ProcessPoolExecutor(max_workers=max(1, min(workers, MAX_WORKERS)), mp_context=ctx,
                                         max_tasks_per_child=1) as pool:
            running = {pool.submit(_plan_point, config, base_overrides + o, target, compile): (o, k, p)
                       for o, k, p in todo}
            for fut in futures.as_completed(running):
                o, key, path = running[fut]
                try:
                    results[key] = fut.result()
                    path.write_text(json.dumps(results[key]))
                except Exception as e:  # one failing point must not lose the others
                    results[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
                print(f"planned {' '.join(o)}", flush=True)
    for overrides, key, path in jobs:
        cached = key not in results
        rows.append(_row(overrides, key, json.loads(path.read_text()) if cached else results[key], cached))
    return rows


def _row(overrides: list[str], key: str, p: dict, cached: bool) -> dict:
    row = {"point": " ".join(overrides), "hash": key, "cached": cached}
    row.update({o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides})
    if "error" in p:
        return {**row, "error": p["error"]}
    compiled = p.get("compiled")
    row.update({
        "device_bytes": compiled["device_total"] if compiled else p["analytic"]["device_total"],
        "device_bytes_basis": p["fits_basis"],
        "analytic_device_bytes": p["analytic"]["device_total"],
        "host_bytes": compiled["host_total"] if compiled else p["analytic"]["host_total"],
        "fits": p["fits"], "host_fits": p["host_fits"],
        "step_seconds_estimated": p["cost"]["step_seconds"], "mfu_estimated": p["cost"]["mfu"],
        "warnings": len(p["warnings"]), "target": p["target"]["name"], "devices": p["devices"],
        "usable_device_bytes": p["usable_device_bytes"],
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
    ok = [r for r in rows if "error" not in r]
    return [r for r in ok if not any(o["device_bytes"] <= r["device_bytes"] and o["step_seconds_estimated"]
                                     <= r["step_seconds_estimated"] and (o["device_bytes"], o["step_seconds_estimated"])
                                     != (r["device_bytes"], r["step_seconds_estimated"]) for o in ok)]


def plot_pareto(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for fits, style in ((True, dict(marker="o", color="tab:green", label="fits")),
                        (False, dict(marker="x", color="tab:red", label="does not fit")),
                        (None, dict(marker="s", color="0.5", label="no capacity known"))):
        sel = [r for r in ok if r["fits"] is fits]
        if sel:
            ax.scatter([r["device_bytes"] / GIB for r in sel], [r["step_seconds_estimated"] for r in sel], **style)
    front = sorted(pareto_front(ok), key=lambda r: r["device_bytes"])
    if front:
        ax.plot([r["device_bytes"] / GIB for r in front], [r["step_seconds_estimated"] for r in front], "k--",
                linewidth=0.8, label="Pareto front")
    usable = {r["usable_device_bytes"] for r in ok if r.get("usable_device_bytes")}
    for u in usable:
        ax.axvline(u / GIB, color="red", linestyle=":", linewidth=1, label="usable capacity (after headroom)")
    for r in ok:
        ax.annotate(r["point"], (r["device_bytes"] / GIB, r["step_seconds_estimated"]), fontsize=6)
    basis = ok[0]["device_bytes_basis"] if ok else "analytic"
    where = f"compiled for {ok[0]['devices']} x {ok[0]['target']} (deviceless)" if basis == "compiled" and ok \
        else "estimated (analytic)"
    ax.set_xlabel(f"device GiB per GPU, {where}")
    ax.set_ylabel("step time, s, estimated (cost model)")
    ax.set_title(f"sweep on {ok[0]['devices']} x {ok[0]['target']}: memory vs estimated step time" if ok
                 else "sweep: no point planned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from jaxmem.aot import add_target_args

    ap = argparse.ArgumentParser(prog="jaxmem sweep", description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a SWEEP.yaml (with `config` and `grid`) or a config YAML with --grid")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to every point")
    ap.add_argument("--grid", action="append", default=[], help="key=v1,v2,... (repeatable)")
    add_target_args(ap)
    ap.add_argument("--out", default=None, help="output folder (default: runs/sweeps/<name>)")
    ap.add_argument("--cache", default=None, help="plan cache folder (default: <out>/cache)")
    ap.add_argument("--workers", type=int, default=MAX_WORKERS)
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
    rows = run_sweep(config, grid, base, target, out, cache, args.workers, not args.no_compile)
    paths = write_outputs(rows, out)
    for r in rows:
        state = r.get("error") or (f"{r['device_bytes'] / GIB:7.2f} GiB ({r['device_bytes_basis']}), "
                                   f"fits={r['fits']}, step {r['step_seconds_estimated']:.3f} s "
                                   f"(estimated){' [cached]' if r['cached'] else ''}")
        print(f"{r['point']:60s} {state}")
    print(f"wrote {paths['csv']}, {paths['json']}, {paths['png']}")
    return 0
