"""`jaxmem explain CONFIG [--target T] [--top N] [--json FILE] [--html/--plot/--timeline-json]`: the buffers live
at the memory peak of the compiled train step (jaxmem.plan.explain), and the step's memory timeline."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxmem.cli.help import HelpFormatter
from jaxmem.config import ConfigError
from jaxmem import registry
from jaxmem.loader import load_config
from jaxmem.plan.explain import explain_with_timeline, render
from jaxmem.runtime.aot import add_target_args, resolve_topology
from jaxmem.plan.timeline_html import write
from jaxmem.plan.timeline_plot import plot_timelines


def main(argv: list[str] | None = None) -> int:
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
    for _, cfg, _ in jobs:
        registry.for_config(cfg).refuse_unsupported(cfg, "explain")
    topos = [resolve_topology(cfg, args.target, args.gpus_per_host, args.hosts) for _, cfg, _ in jobs]
    results, timelines = [], []
    for (path, cfg, overrides), topo in zip(jobs, topos):
        name = " ".join([path, *overrides])
        result, steps = explain_with_timeline(cfg, topo, args.top, args.dump_dir if len(jobs) == 1 else None,
                                              timeline=wants_timeline, config=name)
        which = registry.for_config(cfg).explained_program(cfg)
        if len(jobs) > 1:
            print(name)
        if which:  # a run of several programs: which of them this is
            result["program"] = which
            print(which)
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
        print(f"timeline page: {write(html, timelines)}")
    if plot:
        print(f"timeline plot: {plot_timelines(timelines, plot)}")
    if json_path:
        Path(json_path).write_text(json.dumps(timelines[0] if len(timelines) == 1 else timelines))
        print(f"timeline data: {json_path}")


if __name__ == "__main__":
    sys.exit(main())
