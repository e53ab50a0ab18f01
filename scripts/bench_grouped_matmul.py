"""Grouped matmul (the MoE experts): ragged_dot vs blocked vs pallas, fwd + bwd: memory, and time on a GPU.

    PYTHONPATH=. python scripts/bench_grouped_matmul.py --out DIR [--shape ROWS,D,F,GROUPS] [--plan | --no-plan]
        [--dtypes bfloat16,float32] [--impls blocked,pallas] [--tiles-for h100-80g,a100-80g,rtx4090-24g]

Shape: Qwen3-30B-A3B's experts at 8192 tokens (65536 routed rows = 8192 x top 8, D 2048, F 768, 128 experts),
bf16. With a GPU attached each implementation runs in its own process (fresh peak statistics) on random
inputs routed uniformly at random: the median of 5 fwd+bwd calls after 2 warm-ups (measured on GPU), the
peak bytes in use (measured on GPU) and XLA's temp of that compile (compiled on GPU). Without one: deviceless
compiles for h100-80g (compiled deviceless), and fp32 timings of ragged_dot and blocked on the CPU at
CPU_SHAPES (measured on CPU; Pallas only interprets there). `--plan` (default without a GPU; a deviceless
compile either way, one to two minutes each) adds 4-layer Qwen3-30B-A3B full-remat train steps (PLANS: 1 GPU
at seq 8192, fsdp over 8 GPUs at seq 4096) with each implementation. `--tiles-for` (GPU only) adds a pallas row
per named target: the tiles and stages the kernel fits to that target's shared memory, run on the attached GPU
(how tiles sized for a smaller GPU do on this one; not that GPU's speed). Writes DIR/grouped_matmul.json and
DIR/grouped_matmul.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
QWEN3_30B_A3B = (65536, 2048, 768, 128)
IMPLS = ("ragged_dot", "blocked", "pallas")
TARGET = "h100-80g"
_QWEN3_STEP = ["parallel.rules=fsdp", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
               "precision.master_weights=true", "model.preset=qwen3-30b-a3b", "model.n_layers=4", "remat.preset=full"]
# name -> (overrides, GPUs): 4-layer Qwen3-30B-A3B train steps, full remat, bf16 + fp32 master
PLANS = {
    "1 GPU, seq 8192, micro-batch 1": (_QWEN3_STEP + ["parallel.fsdp=1", "train.micro_batch=1",
                                                      "train.seq_len=8192"], 1),
    "8 GPUs fsdp 8, seq 4096, micro-batch 8": (_QWEN3_STEP + ["parallel.fsdp=8", "train.micro_batch=8",
                                                              "train.seq_len=4096"], 8),
}


def _fn(impl: str):
    import jax

    from jaxmem import kernels
    from jaxmem.config import KernelConfig

    return kernels.select_grouped_matmul(KernelConfig(grouped_matmul=impl), jax.default_backend())


def _steps(impl: str, dtype="bfloat16"):
    """(forward, forward + both gradients) of the selected implementation, unjitted."""
    import jax

    fn = _fn(impl)

    def fwd_bwd(x, w, sizes):
        out, pullback = jax.vjp(lambda x, w: fn(x, w, sizes, preferred_element_type=dtype), x, w)
        return pullback(out)

    return (lambda x, w, sizes: fn(x, w, sizes, preferred_element_type=dtype)), fwd_bwd


def deviceless_case(impl: str, shape) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxmem.runtime.aot import compile_abstract, target_devices

    rows, d, f, groups = shape
    sharding = jax.sharding.SingleDeviceSharding(target_devices(TARGET, 1)[0])
    args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups, d, f), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sharding))
    fwd, fwd_bwd = _steps(impl)
    out = {"impl": impl, "how": f"compiled deviceless ({TARGET}, jax {jax.__version__})"}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        start = time.perf_counter()
        out[f"{name}_temp_gib"] = compile_abstract(fn, *args).memory_analysis().temp_size_in_bytes / GIB
        out[f"{name}_compile_s"] = time.perf_counter() - start
    return out


def _fit_tiles_to(target: str) -> None:
    """Make the Pallas kernel size its tiles for `target`'s shared memory instead of the attached GPU's."""
    from jaxmem.config.targets import TARGETS
    from jaxmem.kernels.grouped_matmul import pallas

    budget = TARGETS[target].shared_memory_per_block_optin
    pallas._shared_memory = lambda: budget


def gpu_case(impl: str, shape, dtype="bfloat16", tiles_for: str = "") -> dict:
    """Timed on the attached device (a GPU; the CPU for `cpu_case`), rows routed uniformly at random."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if tiles_for:
        _fit_tiles_to(tiles_for)

    rows, d, f, groups = shape
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (rows, d), dtype)
    w = (jax.random.normal(k[1], (groups, d, f), jnp.float32) * d**-0.5).astype(dtype)
    sizes = jnp.asarray(np.bincount(np.random.default_rng(0).integers(0, groups, rows), minlength=groups), jnp.int32)
    fwd, fwd_bwd = _steps(impl, dtype)
    device = jax.devices()[0]
    where = "GPU" if device.platform == "gpu" else "CPU"
    tiles = f", tiles fitted to {tiles_for}'s shared memory" if tiles_for else ""
    out = {"impl": impl, "device": device.device_kind, "jax": jax.__version__, "shape": list(shape), "dtype": dtype,
           "tiles_for": tiles_for,
           "how": f"measured on {where} ({device.device_kind}, jax {jax.__version__}, {dtype}{tiles}); temp: "
                  f"compiled for that {where}"}
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        compiled = jax.jit(fn).lower(x, w, sizes).compile()
        out[f"{name}_temp_gib"] = compiled.memory_analysis().temp_size_in_bytes / GIB
        for _ in range(2):
            jax.block_until_ready(compiled(x, w, sizes))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(compiled(x, w, sizes))
            times.append(time.perf_counter() - start)
        out[f"{name}_ms"] = 1e3 * sorted(times)[2]
    stats = device.memory_stats() or {}
    out["peak_gib"] = stats.get("peak_bytes_in_use", 0) / GIB
    flops = 6 * rows * d * f  # the active products: forward, d_lhs, d_rhs
    out["active_tflops_per_s"] = flops / (out["fwd_bwd_ms"] * 1e-3) / 1e12
    return out


CPU_SHAPES = ((4096, 256, 128, 16), (4096, 256, 128, 64))  # small enough for a CPU: ragged_dot takes seconds


def cpu_case(impl: str, shape) -> dict:
    """Without a GPU: the same timing on the CPU in fp32 (its native matmul dtype), at CPU_SHAPES."""
    return [gpu_case(impl, cpu_shape, "float32") for cpu_shape in CPU_SHAPES]


def plan_case(name: str, impl: str) -> dict:
    import jax

    from jaxmem.loader import load_config
    from jaxmem.plan.compiled import compile_for_plan
    from jaxmem.runtime.compiled_memory import device_bytes
    from jaxmem.runtime.aot import resolve_topology

    overrides, gpus = PLANS[name]
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(str(root / "configs" / "tiny.yaml"), overrides + [f"kernels.grouped_matmul={impl}"])
    start = time.perf_counter()
    _, figures = compile_for_plan(cfg, resolve_topology(cfg, TARGET, gpus))
    return {"plan": name, "impl": impl, "how": f"compiled deviceless ({gpus} x {TARGET}, jax {jax.__version__})",
            "device_total_gib": device_bytes(figures.fields) / GIB, "temp_gib": figures.fields["temp"] / GIB,
            "compile_s": time.perf_counter() - start}


def _subprocess(kind: str, impl: str, shape, timeout: int, plan: str = "", dtype: str = "bfloat16",
                tiles_for: str = "") -> dict:
    cmd = [sys.executable, __file__, "--case", kind, impl, "--shape", ",".join(map(str, shape)), "--plan-name", plan,
           "--dtypes", dtype, "--tiles-for", tiles_for]
    # ragged_dot's dense lowering needs 64 GiB of temp at the default shape: more than jax's default 75% pool
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    for line in reversed(run.stdout.splitlines()):
        if line.startswith(("{", "[")):
            return json.loads(line)
    return {"plan": plan, "impl": impl, "dtype": dtype, "tiles_for": tiles_for,
            "error": (run.stderr or run.stdout).strip().splitlines()[-1:]}


def kernel_table(cases: list[dict], how: bool = True) -> list[str]:
    """Markdown lines of a table of kernel cases (gpu_case / deviceless_case rows): one row per implementation,
    dtype and tiles; with `how`, a last column saying how each row's figures were obtained."""
    lines = ["| implementation | dtype | fwd temp GiB | fwd+bwd temp GiB | fwd ms | fwd+bwd ms | peak GiB |"
             + (" how |" if how else ""), "|---|---|---:|---:|---:|---:|---:|" + ("---|" if how else "")]
    cell = lambda case, key: f"{case[key]:.2f}" if key in case else ""  # noqa: E731
    for case in cases:
        impl = case["impl"] + (f" (tiles for {case['tiles_for']})" if case.get("tiles_for") else "")
        if "error" in case:
            lines.append(f"| {impl} | {case.get('dtype', '')} | | | | | | failed: {case['error']} |")
            continue
        lines.append(f"| {impl} | {case.get('dtype', 'bfloat16')} | " + " | ".join(
            cell(case, key) for key in ("fwd_temp_gib", "fwd_bwd_temp_gib", "fwd_ms", "fwd_bwd_ms", "peak_gib"))
            + (f" | {case['how']} |" if how else " |"))
    return lines


def _markdown(result: dict) -> str:
    rows, d, f, groups = result["shape"]
    lines = ["# Grouped matmul (MoE experts): ragged_dot vs blocked vs pallas", "",
             f"Generated by `scripts/bench_grouped_matmul.py`. Shape: {rows} routed rows (8192 tokens x top 8), "
             f"D {d}, F {f}, {groups} experts, bf16 (Qwen3-30B-A3B's experts). Each row says how its figures were "
             "obtained. fwd+bwd: the output and both gradients, pulled back with the output itself as the "
             "upstream gradient (the gradient of a plain sum, a constant cotangent, lets XLA fold part of the "
             "backward: ragged_dot then compiles to 44 GiB of temp instead of 64).", "",
             *kernel_table(result["kernel"])]
    if result.get("cpu"):
        lines += ["", "## Timed on the CPU (no GPU attached), fp32, rows routed uniformly at random", "",
                  "| implementation | rows, D, F, groups | fwd ms | fwd+bwd ms | how |", "|---|---|---:|---:|---|"]
        for case in result["cpu"]:
            if "error" in case:
                lines.append(f"| {case['impl']} | | | | failed: {case['error']} |")
                continue
            lines.append(f"| {case['impl']} | {', '.join(map(str, case['shape']))} | {case['fwd_ms']:.1f} | "
                         f"{case['fwd_bwd_ms']:.1f} | {case['how']} |")
    for name, (overrides, gpus) in PLANS.items():
        cases = [case for case in result.get("plan", []) if case.get("plan") == name]
        if not cases:
            continue
        lines += ["", f"## The 4-layer Qwen3-30B-A3B train step: {name} (full remat, bf16 + fp32 master)", "",
                  "`jaxmem plan configs/tiny.yaml " + " ".join(overrides) +
                  f" kernels.grouped_matmul=IMPL --target {TARGET} --gpus-per-host {gpus}`", "",
                  "| kernels.grouped_matmul | device total GiB | temp GiB | how |", "|---|---:|---:|---|"]
        for case in cases:
            if "error" in case:
                lines.append(f"| {case['impl']} | | | failed: {case['error']} |")
                continue
            lines.append(f"| {case['impl']} | {case['device_total_gib']:.2f} | {case['temp_gib']:.2f} | "
                         f"{case['how']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks")
    ap.add_argument("--shape", default=",".join(map(str, QWEN3_30B_A3B)), help="ROWS,D,F,GROUPS")
    ap.add_argument("--plan", action=argparse.BooleanOptionalAction, default=None,
                    help="also plan the 4-layer Qwen3-30B-A3B steps (default: only without a GPU)")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated input dtypes of the kernel rows")
    ap.add_argument("--impls", default=",".join(IMPLS), help="comma-separated implementations")
    ap.add_argument("--tiles-for", default="", help="GPU only: comma-separated targets (config.targets) for "
                    "extra pallas rows with the tiles fitted to that target's shared memory")
    ap.add_argument("--case", nargs=2, metavar=("KIND", "IMPL"), help=argparse.SUPPRESS)
    ap.add_argument("--plan-name", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.case:  # one case in this process: a JSON line on stdout
        kind, impl = args.case
        case = {"gpu": gpu_case, "deviceless": deviceless_case, "cpu": cpu_case}.get(kind)
        if kind == "plan":
            print(json.dumps(plan_case(args.plan_name, impl)))
        elif kind == "gpu":
            print(json.dumps(gpu_case(impl, shape, args.dtypes, args.tiles_for)))
        else:
            print(json.dumps(case(impl, shape)))
        return 0
    import jax

    gpu = jax.default_backend() == "gpu"
    kind = "gpu" if gpu else "deviceless"
    impls, dtypes = args.impls.split(","), args.dtypes.split(",") if gpu else ["bfloat16"]
    variants = [(impl, "") for impl in impls]
    if gpu and "pallas" in impls:
        variants += [("pallas", target) for target in filter(None, args.tiles_for.split(","))]
    result = {"shape": list(shape), "kernel": [_subprocess(kind, impl, shape, 300, dtype=dtype, tiles_for=tiles)
                                               for dtype in dtypes for impl, tiles in variants]}
    if not gpu:
        timed = [_subprocess("cpu", impl, shape, 300) for impl in ("ragged_dot", "blocked")]
        result["cpu"] = [row for rows in timed for row in (rows if isinstance(rows, list) else [rows])]
    if args.plan if args.plan is not None else not gpu:
        result["plan"] = [_subprocess("plan", impl, shape, 900, name) for name in PLANS for impl in IMPLS]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "grouped_matmul.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "grouped_matmul.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
