"""`jaxmem plan CONFIG [CONFIG ...] [key=value ...] [--target T] [--json FILE] [--plot FILE]`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from jaxmem.runtime.aot import add_target_args
from jaxmem.cli.help import HelpFormatter
from jaxmem.config.schema import ConfigError
from jaxmem.plan import plan, resolve_topology
from jaxmem.plan.allocator import remember
from jaxmem.plan.report import render
from jaxmem.loader import load_config
from jaxmem.plan.plot import plot_plans
from jaxmem.plan.generation import check as check_generation, plan_generation, render_lines as render_generation


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="jaxmem plan", formatter_class=HelpFormatter,
        description="The per-device memory bill of each config's train step for a target GPU: the analytic "
                    "bill by category and XLA's compiled figures (compiled deviceless on this machine), whether "
                    "it fits under the device memory less target.headroom, and the cost model's estimated step "
                    "time and MFU. Overrides apply to every config; with several configs, one bar per config in "
                    "--plot. Exits 1 when a config does not fit.",
        epilog="examples:\n"
               "  jaxmem plan configs/llama3-8b-8xh100.yaml --json plan.json --plot bill.png\n"
               "  jaxmem plan configs/llama3-8b-8xh100.yaml --target h200-141g --gpus-per-host 8\n"
               "  jaxmem plan configs/ladder/*.yaml --plot ladder.png        # one bar per config\n"
               "  jaxmem plan configs/tiny.yaml remat.preset=full --no-compile   # analytic bill only\n"
               "targets: `jaxmem list targets`; config keys: docs/config.md")
    ap.add_argument("items", nargs="+", help="config YAML files, then dotted key=value overrides for all of them")
    add_target_args(ap)
    ap.add_argument("--json", dest="json_path", default=None, help="write the plan(s) as JSON")
    ap.add_argument("--plot", default=None, help="write a PNG stacked-bar chart (one bar per config)")
    ap.add_argument("--no-compile", action="store_true", help="analytic bill and cost model only")
    return ap.parse_intermixed_args(argv)


def split_items(items: list[str]) -> tuple[list[str], list[str]]:
    configs = [i for i in items if "=" not in i]
    overrides = [i for i in items if "=" in i]
    if not configs:
        raise ConfigError("plan: give at least one config file")
    for c in configs:
        if not Path(c).is_file():
            raise ConfigError(f"{c}: config file not found")
    return configs, overrides


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configs, overrides = split_items(args.items)
    # Resolve and validate every config before the first compile.
    jobs = []
    for path in configs:
        cfg = load_config(path, overrides)
        check_generation(cfg)
        jobs.append((path, cfg, resolve_topology(cfg, args.target, args.gpus_per_host, args.hosts)))
    plans = []
    for path, cfg, topo in jobs:
        result = plan(cfg, topo, compile=not args.no_compile, source=path)
        if "lines" in result:  # a feature's run of several programs (GRPO: rollout and training), rendered by it
            remember(result)  # its run peak, the largest phase, for the allocator of `jaxmem train`
            print("\n".join(result["lines"]))
            plans.append(result)
            continue
        remember(result)  # `jaxmem train` reads the compiled total back to set XLA's allocator
        render(result)
        if cfg.generate.batch:  # the generate: section: the cache and the generation program's peak
            result["generation"] = plan_generation(cfg, topo, compile=not args.no_compile)
            print("\n".join(render_generation(result["generation"])))
        plans.append(result)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(plans[0] if len(plans) == 1 else plans, indent=2))
    if args.plot:
        plot_plans(plans, args.plot, labels=[Path(p).stem for p in configs])
    return 0 if all(p["fits"] is not False for p in plans) else 1
