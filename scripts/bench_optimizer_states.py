"""The optimizer state kinds' training quality: tiny Llama (configs/tiny.yaml) and tiny MoE (configs/tiny-moe.yaml)
trained the same number of steps from the same seed and data with each kind of optimizer state, on one CPU
device and on an fsdp=8 mesh of 8 CPU devices, and whether a run resumed from a mid-run checkpoint equals the
straight one. Writes benchmarks/optimizer_states.json and .md (measured on CPU).

Each (model, mesh) runs in its own process (the device count is fixed at jax's start); inside it every kind
trains in turn with `jaxmem.train.run`. "final" is the mean loss of the last FINAL_WINDOW steps (the step losses
of the synthetic Markov data are noisy); each kind's final is compared with fp32 AdamW's of the same model and
mesh. Goals (issue 45): int8 moments within 2%, int4 within 5%, bf16 weights with stochastic rounding and no
fp32 master within 2%, Adafactor's final below 50% of its first step's loss; fp8 moments (issue 53) within 2%.

    JAX_PLATFORMS=cpu python scripts/bench_optimizer_states.py --json benchmarks/optimizer_states.json \\
        --md benchmarks/optimizer_states.md [--steps 300] [--kinds "fp8 moments"]

`--kinds` trains only the kinds named (and fp32 AdamW's baseline only where the --json it adds them to has none):
their rows join those of the existing --json, whose other kinds are kept as measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FINAL_WINDOW = 10
MODELS = {"tiny": "configs/tiny.yaml", "tiny-moe": "configs/tiny-moe.yaml"}
MESHES = {"1 device": 1, "fsdp=8": 8}
BF16 = ["precision.param_dtype=bfloat16", "precision.master_weights=false"]
# name -> (overrides, goal: ("vs_fp32", max relative gap) or ("vs_first", max final / first), bytes per param)
KINDS = {
    "fp32 AdamW": ([], None, "4 + 8 (fp32 weights, fp32 m and v)"),
    "int8 moments": (["precision.moment_dtype=int8"], ("vs_fp32", 0.02), "4 + ~2"),
    "int4 moments": (["precision.moment_dtype=int4"], ("vs_fp32", 0.05), "4 + ~1"),
    "fp8 moments": (["precision.moment_dtype=float8"], ("vs_fp32", 0.02), "4 + ~2"),
    "bf16 weights, stochastic rounding, no master": (BF16, ("vs_fp32", 0.02), "2 + 8"),
    "bf16 weights, round to nearest, no master": (BF16 + ["precision.stochastic_rounding=false"], None, "2 + 8"),
    "int8 moments + bf16 weights, stochastic rounding": (BF16 + ["precision.moment_dtype=int8"], None, "2 + ~2"),
    "Adafactor": (["optimizer.name=adafactor"], ("vs_first", 0.5), "4 + ~0 (factored v, no m)"),
}
BASELINE = "fp32 AdamW"  # each kind's gap is against its final loss
RESUME_AT = 0.5  # the resumed run restarts from the checkpoint saved at this fraction of the steps


def _config(model: str, devices: int, steps: int, out_dir: Path, overrides: list[str], every: int):
    from jaxmem.loader import load_config

    return load_config(ROOT / MODELS[model], [
        f"out_dir={out_dir}", "train.progress=false", f"train.steps={steps}", "train.log_every=1",
        f"parallel.fsdp={devices}", f"checkpoint.every={every}", "checkpoint.async_save=false",
        "checkpoint.every_minutes=0", *overrides])


def _one_kind(model: str, devices: int, steps: int, overrides: list[str], resume: bool) -> dict:
    """Trains one kind straight (saving at RESUME_AT of the way), then, with `resume`, again from that
    checkpoint in a copy of the run folder: the losses, and whether the resumed ones equal the straight ones."""
    from jaxmem.train import run

    half = max(1, int(steps * RESUME_AT))
    with tempfile.TemporaryDirectory(prefix="optstates-") as tmp:
        out = Path(tmp) / "straight"
        start = time.perf_counter()
        straight = run(_config(model, devices, steps, out, overrides, half))
        seconds = time.perf_counter() - start
        losses = [r["loss"] for r in straight["records"]]
        result = {"losses": losses, "first": losses[0], "final": sum(losses[-FINAL_WINDOW:]) / FINAL_WINDOW,
                  "seconds": seconds}
        if resume:
            again = Path(tmp) / "resumed"
            shutil.copytree(out / "checkpoints" / str(half), again / "checkpoints" / str(half))
            resumed = run(_config(model, devices, steps, again, overrides, half))
            tail = [r["loss"] for r in resumed["records"]]
            result.update(resumed_from=resumed["resumed_from"], resume_equal=tail == losses[half:],
                          resume_max_abs_diff=max(abs(a - b) for a, b in zip(tail, losses[half:])))
    return result


def child(model: str, devices: int, steps: int, resume: bool, kinds: list[str]) -> dict:
    import jax

    out = {"model": model, "devices": devices, "device_kind": jax.devices()[0].device_kind, "kinds": {}}
    for name in kinds:
        out["kinds"][name] = _one_kind(model, devices, steps, KINDS[name][0], resume)
        print(f"{model} x{devices} {name}: final {out['kinds'][name]['final']:.4f}", file=sys.stderr, flush=True)
    return out


def _run_child(model: str, devices: int, args, kinds: list[str]) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, __file__, "--child", model, "--devices", str(devices), "--steps", str(args.steps),
           "--kinds", ",".join(kinds)]
    cmd += ["--resume"] if args.resume else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"bench_optimizer_states: {model} on {devices} devices failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def verdicts(run: dict) -> dict:
    """Each kind's gap to fp32 AdamW's final loss and whether it meets its goal."""
    base = run["kinds"][BASELINE]["final"]
    out = {}
    for name, (_, goal, _) in KINDS.items():
        if name not in run["kinds"]:
            continue
        k = run["kinds"][name]
        gap = k["final"] / base - 1
        met = None
        if goal and goal[0] == "vs_fp32":
            met = abs(gap) <= goal[1]
        elif goal:
            met = k["final"] < goal[1] * k["first"]
        out[name] = {"gap_vs_fp32": gap, "final_over_first": k["final"] / k["first"], "goal_met": met}
    return out


def _goal_text(goal) -> str:
    if goal is None:
        return "-"
    return f"within {goal[1]:.0%} of fp32" if goal[0] == "vs_fp32" else f"final < {goal[1]:.0%} of first"


def markdown(result: dict) -> str:
    lines = ["# Optimizer state kinds: training quality", "",
             f"Measured on CPU ({result['machine']}): {result['steps']} steps of each model from train.seed, the "
             "same synthetic data for every kind, lr and schedule as the config's; \"final\" = mean loss of the last "
             f"{FINAL_WINDOW} steps; gap = final / fp32 AdamW's final - 1 (same model and mesh). Memory per "
             "parameter of each kind: docs/optimizers.md (compiled deviceless). " + ", ".join(
                 f"{k} {v}" for k, v in result["versions"].items()) + ".",
             "Regenerate: `JAX_PLATFORMS=cpu python scripts/bench_optimizer_states.py --json "
             "benchmarks/optimizer_states.json --md benchmarks/optimizer_states.md --resume`.", "",
             "| model | mesh | state kind | bytes/param (weights + state) | first loss | final loss | gap vs fp32 "
             "| goal | met | resumed = straight |", "|---|---|---|---|---:|---:|---:|---|---|---|"]
    for run in result["runs"]:
        for name, v in run["verdicts"].items():
            k = run["kinds"][name]
            met = {True: "yes", False: "**no**", None: "-"}[v["goal_met"]]
            resumed = "-" if "resume_equal" not in k else "yes" if k["resume_equal"] else (
                f"**no** (max diff {k['resume_max_abs_diff']:.2e})")
            lines.append(f"| {run['model']} | {run['mesh']} | {name} | {KINDS[name][2]} | {k['first']:.4f} | "
                         f"{k['final']:.4f} | {v['gap_vs_fp32']:+.2%} | {_goal_text(KINDS[name][1])} | {met} | "
                         f"{resumed} |")
    lines += ["", "## Loss curves", "", "Every 25th step's loss (the json holds every step).", ""]
    for run in result["runs"]:
        lines.append(f"### {run['model']}, {run['mesh']}")
        lines.append("")
        steps = list(range(0, result["steps"], 25)) + [result["steps"] - 1]
        lines.append("| state kind | " + " | ".join(str(s + 1) for s in steps) + " |")
        lines.append("|---|" + "---:|" * len(steps))
        for name, k in run["kinds"].items():
            lines.append(f"| {name} | " + " | ".join(f"{k['losses'][s]:.3f}" for s in steps) + " |")
        lines.append("")
    return "\n".join(lines)


def _earlier_runs(args) -> dict:
    """(model, mesh) -> run of the --json this run adds its kinds to (same steps), or {} where there is none."""
    if not (args.json and Path(args.json).is_file()):
        return {}
    earlier = json.loads(Path(args.json).read_text())
    if earlier["steps"] != args.steps:
        sys.exit(f"bench_optimizer_states: {args.json} ran {earlier['steps']} steps, this run {args.steps}")
    return {(run["model"], run["mesh"]): run for run in earlier["runs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None)
    parser.add_argument("--resume", action="store_true", help="also resume each run from its mid-run checkpoint")
    parser.add_argument("--from-json", default=None, help="write --md from a JSON this script wrote; run nothing")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--kinds", default=None, help="comma-separated kinds to train (names of KINDS); their rows "
                                                      "join the existing --json's")
    args = parser.parse_args()
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; use names of {list(KINDS)}")
    if args.child:
        print(json.dumps(child(args.child, args.devices, args.steps, args.resume, kinds)))
        return
    if args.from_json:
        if not args.md:
            parser.error("--from-json writes the table to --md FILE; give one")
        Path(args.md).write_text(markdown(json.loads(Path(args.from_json).read_text())) + "\n")
        return
    from importlib.metadata import version

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    result = {"steps": args.steps, "machine": f"{os.cpu_count()} cores, {cpu}", "label": "measured on CPU",
              "versions": {p: version(p) for p in ("jax", "jaxlib", "optax")}, "runs": []}
    earlier = _earlier_runs(args) if args.kinds else {}
    if earlier:  # the kept rows were measured where the --json's were
        result["machine"] = (f"{json.loads(Path(args.json).read_text())['machine']}; {', '.join(kinds)}: "
                             f"{result['machine']}")
    for model in MODELS:
        for mesh, devices in MESHES.items():
            before = earlier.get((model, mesh), {"kinds": {}})
            todo = [k for k in kinds if k != BASELINE]
            if BASELINE in kinds or BASELINE not in before["kinds"]:  # every gap is against this run's baseline
                todo = [BASELINE] + todo
            run = dict(_run_child(model, devices, args, todo), mesh=mesh)
            run["kinds"] = {name: run["kinds"].get(name) or before["kinds"][name]
                            for name in KINDS if name in run["kinds"] or name in before["kinds"]}
            run["verdicts"] = verdicts(run)
            result["runs"].append(run)
            if args.json:  # after each (model, mesh): a long run that stops keeps what it measured (and the
                # --json's runs it has not reached yet)
                done = {(r["model"], r["mesh"]) for r in result["runs"]}
                rest = [r for key, r in earlier.items() if key not in done]
                Path(args.json).write_text(json.dumps(dict(result, runs=result["runs"] + rest), indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(result) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
