"""The step-time cost model (jaxmem/plan/costmodel.py) against train steps measured on real GPUs.

Reads benchmarks/calibration/h100_measured.json (H100 rows, and H200 rows with target h200-141g; append rows
there and re-run), builds each case's plan
with the project's own plan API (the analytic bill and its layout: no compile), runs the cost model for
the measuring device and writes benchmarks/costmodel.json and benchmarks/costmodel.md.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/bench_costmodel.py [--data FILE] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "calibration" / "h100_measured.json"
TOLERANCE = 0.25  # the issue's goal: every measured case within +-25%


def load_cases(path: Path = DATA) -> list[dict]:
    """The data file's cases with its defaults filled in."""
    data = json.loads(Path(path).read_text())
    defaults = data.get("defaults", {})
    return [{**defaults, **case} for case in data["cases"]]


def estimate_case(case: dict):
    """(cfg, bill, Cost) for one measured case, estimated for the device it was measured on."""
    from jaxmem.loader import load_config
    from jaxmem.plan.bill import compute_bill
    from jaxmem.plan.costmodel import LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM, estimate
    from jaxmem.config.targets import get_target

    cwd = os.getcwd()
    os.chdir(ROOT)  # config paths in the data file are relative to the repository root
    try:
        cfg = load_config(case["config"], list(case.get("overrides", [])) + list(case.get("pinned_overrides", [])))
    finally:
        os.chdir(cwd)
    n = int(case.get("n_devices", 1))
    bill = compute_bill(cfg, n, gpu=True)
    # a case measured with the layer-scan host update is priced at that update's measured rate
    rate = LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM if case.get("host_update") == "layer_scan" else None
    cost = estimate(cfg, bill, get_target(case["target"]), n, bill.layout.grad_accum, bill.layout.rows, rate)
    return cfg, bill, cost


def evaluate(cases: list[dict]) -> list[dict]:
    rows = []
    for case in cases:
        cfg, bill, cost = estimate_case(case)
        measured = case.get("measured_step_seconds") or case["tokens_per_step"] / case["measured_tokens_per_s"]
        kernels = bill.layout.kernels
        if case.get("attention") and case["attention"] != kernels["attention"]:
            raise SystemExit(f"{case['name']}: the data file says attention={case['attention']}, the config "
                             f"resolves {kernels['attention']}")
        if cost.tokens_per_step != case["tokens_per_step"]:
            raise SystemExit(f"{case['name']}: {cost.tokens_per_step} tokens per step, the data file says "
                             f"{case['tokens_per_step']}")
        ratio = cost.step_seconds / measured
        rows.append({
            "name": case["name"], "config": case["config"], "overrides": case.get("overrides", []),
            "pinned_overrides": case.get("pinned_overrides", []),
            "target": case["target"], "n_devices": case.get("n_devices", 1), "offload": bool(case.get("offload")),
            "attention": kernels["attention"], "loss": kernels["loss"], "remat": cfg.remat.preset,
            "source": case.get("source", ""),
            "measured_step_seconds": measured, "measured_label": "measured on GPU",
            "estimated_step_seconds": cost.step_seconds, "estimated_label": "estimated (cost model)",
            "ratio": ratio, "within_tolerance": abs(ratio - 1) <= TOLERANCE,
            "estimated_host_link_seconds": cost.host_link_seconds,
            "estimated_serial_host_seconds": cost.serial_host_seconds,
            "estimated_mfu": cost.mfu, "breakdown": cost.breakdown,
        })
    return rows


def _md(rows: list[dict], source: str) -> str:
    from jaxmem.moe import cost as moe_cost
    from jaxmem.optim import states
    from jaxmem.plan import costmodel as cm

    def line(r):
        b = r["breakdown"]
        ok = "yes" if r["within_tolerance"] else "**no**"
        return (f"| {r['name']} | {r['remat']} / {r['attention']} / {r['loss']} | {r['measured_step_seconds']:.3f} | "
                f"{r['estimated_step_seconds']:.3f} | {r['ratio']:.2f} | {ok} | {b['matmul_seconds'] * 1e3:.0f} | "
                f"{b['attention_seconds'] * 1e3:.0f} | {b['loss_seconds'] * 1e3:.0f} | "
                f"{b['memory_bound_seconds'] * 1e3:.0f} | {b['layer_overhead_seconds'] * 1e3:.0f} | "
                f"{r['estimated_host_link_seconds']:.2f} |")

    head = ("| case | remat / attention / loss | measured s (measured on GPU) | estimated s (cost model) | "
            "ratio | within +-25%? | matmul ms | attention ms | loss ms | memory-bound ms | per-layer ms | "
            "host link s |\n|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    h100 = [r for r in rows if r["target"] == "h100-80g"]
    plain = [r for r in h100 if not r["offload"]]
    off = [r for r in h100 if r["offload"]]
    other = [r for r in rows if r["target"] != "h100-80g"]
    worst = max(abs(r["ratio"] - 1) for r in plain) if plain else 0.0
    kernel = lambda r: r["breakdown"].get("grouped_matmul_kernel", "")  # noqa: E731
    worst_other = max(abs(r["ratio"] - 1) for r in other) if other else 0.0
    return "\n".join([
        "# Step-time cost model vs measured train steps",
        "",
        f"Written by `scripts/bench_costmodel.py` from `benchmarks/calibration/h100_measured.json` ({source}). "
        "Measured: median step on the GPU. Estimated: `jaxmem/plan/costmodel.py` for the measuring device "
        "(its target, 1 device), from the analytic bill's layout (no compile). Ratio = estimated / measured.",
        "",
        "## H100, without host offload (goal: every row within +-25%)",
        head, *map(line, plain),
        "",
        f"Worst: {worst:.0%} off.",
        "",
        "## H100, with host offload (checked on the host link)",
        head, *map(line, off),
        "",
        "## H200 (out of sample, one H200, jax 0.11.2, `jaxmem bench`, benchmarks/bench_h200/)",
        "",
        "Every constant but two was fitted on the H100 rows above before these ran: the grouped-matmul rates come "
        "from the H200 kernel timings alone (the MoE rows: kernel "
        + ", ".join(sorted({f"`{kernel(r)}`" for r in other if kernel(r)})) + "), and LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM "
        "from the one row whose update runs on the host (h200_gemma3_x6_s8k_host_update, in sample: it matches "
        "by construction).",
        head, *map(line, other),
        "",
        f"Worst: {worst_other:.0%} off.",
        "",
        "## The model and how its constants were fitted",
        "",
        "Step = matmuls + attention + loss + memory-bound + per-layer overhead (one stream, serial), "
        "max'ed with collectives and in-step host transfers (overlapped), plus the optimizer state streamed "
        "through the device after the backward when it lives on the host (serial), or the update's time on the "
        "host CPU when it runs there (serial).",
        "",
        f"- Attention, per kernel, on the FLOPs the kernel runs (causal = half of unmasked; fwd + bwd = "
        f"3.5 x fwd because the flash backward redoes the score matmuls; +1 fwd when remat reruns it): "
        f"{cm.ATTENTION_EFFICIENCY} of peak. From the kernel timings only (B=1 N=32 K=8 H=128): pallas "
        "6.09 ms at seq 8192 (0.32) and 82.8 ms at 32768 (0.38), cuDNN 4.22 / 54.8 ms (0.46 / 0.57); "
        "geometric means. The 1B (head_dim 64) uses the same rates (not measured at that shape); its 32k row comes out 8% low.",
        f"- Loss (LM head + CE), per kernel, on its matmul passes (chunked recomputes the logits in the "
        f"backward: 4 passes, naive 3): {cm.LOSS_EFFICIENCY}. From the T=8192 D=4096 V=128256 kernel "
        "timings (chunked 87.9 ms at 1024 x 4096 tiles, naive 77.0, pallas 733 (old kernel), triton 1384 (removed)); "
        "the chunked rate follows its tile from the same day's sweep (2048 x 8192 72.1 ms, 4096 x 4096 72.5, "
        "8192 x 2048 65.1), nearest measured tile otherwise. The train rows ran 1024 x 4096 (pinned).",
        f"- Projection / MLP matmuls at MATMUL_EFFICIENCY = {cm.MATMUL_EFFICIENCY}, memory-bound work "
        f"(norms, RoPE, SiLU, residual adds: read + write per layer, x3 for fwd + bwd, +1 with remat; the "
        f"AdamW update: grads x2, params x2, master / m / v read + written) at HBM_EFFICIENCY = "
        f"{cm.HBM_EFFICIENCY} of 3.35 TB/s, and LAYER_OVERHEAD_SECONDS = {cm.LAYER_OVERHEAD_SECONDS} per "
        "decoder layer: fitted together (least squares on log ratio) to the non-offload rows. The fit is flat "
        "along matmul vs HBM efficiency (0.65 / 0.9 to 0.75 / 0.6 fit equally well), so both stay at 0.7; "
        "the per-layer cost is what the data pins down (the 16-layer 1B spends more per FLOP than the "
        "8-layer 8B-width at the same seq). The old model "
        "(0.7 x peak on all FLOPs, attention unmasked) said 0.126 s for 1b_s8k: it left out the slow loss "
        "kernel, the memory-bound work and the per-layer cost, and counted attention at matmul speed.",
        f"- Host link at HOST_LINK_EFFICIENCY = {cm.HOST_LINK_EFFICIENCY} x the target's 55 GB/s, the two "
        "directions one after the other, with the bytes that cross it: offloaded layer inputs out and back "
        "in; with params on host each layer's weights in for the forward and again for the backward and its "
        "grads out; with the optimizer on host and the update on the device master, m and v in AND out, "
        "plus (params on host) the layer grads in twice (global norm, update), old params in, new params "
        "out. Not fitted: the 4090 recipe's ~92 GB at 55 GB/s lands near the measured 1.86 s.",
        f"- The AdamW update on the host CPU (offload.optimizer_update=host), serial, per trained parameter. The "
        f"measured case ran the layer-scan update at LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM = "
        f"{cm.LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM:.3g} s: Gemma 3 12B widths x 6 layers (2.35B params) on one "
        "H200's 16-core host, 13.17 s per step against 1.21 s with the same state streamed through the GPU "
        "(update on the device); it is that host's rate (XLA:CPU kept 1-2 cores busy) and prices that case. The "
        "step now runs the whole-tensor update (jaxmem.optim.host_update), priced at "
        f"host update seconds per param by state kind = {states.host_update_rates()} s (estimated: "
        "the update alone on one H100 machine's host CPU, benchmarks/host_update_gpu_host.md; not yet measured in "
        "a GPU train step).",
        "- A mixture of experts' expert matmuls (the k active experts' FLOPs) at the grouped matmul's own rate, "
        "by kernel and by shape (a device's routed rows per expert, D, F; the nearest measured shape): one H200, "
        "bf16, fwd + both gradients, e.g. Qwen3-30B-A3B's experts at 8192 tokens (512 rows per expert, 2048 x "
        f"768): pallas {moe_cost.GROUPED_MATMUL_EFFICIENCY_BY_SHAPE['pallas'][(512, 2048, 768)]}, blocked "
        f"{moe_cost.GROUPED_MATMUL_EFFICIENCY_BY_SHAPE['blocked'][(512, 2048, 768)]} of peak; Mixtral-8x7B's (2048 rows "
        f"per expert, 4096 x 14336): pallas {moe_cost.GROUPED_MATMUL_EFFICIENCY_BY_SHAPE['pallas'][(2048, 4096, 14336)]}, "
        f"blocked {moe_cost.GROUPED_MATMUL_EFFICIENCY_BY_SHAPE['blocked'][(2048, 4096, 14336)]} "
        "(benchmarks/gpu_h200.md). Before, they ran at MATMUL_EFFICIENCY: the Qwen3 steps came out at 0.40 "
        "(blocked) and 0.76 (pallas) of measured.",
        "- Not modelled: LoRA adapters on the experts (their rank-wide grouped matmuls count at the dense rate; "
        "the QLoRA MoE rows come out 25-38% low, most with blocked); the short-sequence QLoRA 8B step (seq 512, "
        "32 layers) comes out 42% high, its per-layer cost below the one fitted on seq >= 8192 steps. "
        "The 1B no-remat step measured slower than selective (0.252 vs 0.245 s) though it "
        "does less work; the model puts it below. Recompute for cuDNN under selective is counted like "
        "pallas (its softmax statistics are an unnamed custom-call residual), inferred, not compiled.",
        "",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks"))
    args = ap.parse_args(argv)
    data = json.loads(Path(args.data).read_text())
    rows = evaluate(load_cases(Path(args.data)))
    source = data.get("defaults", {}).get("source", "")
    out = Path(args.out_dir)
    (out / "costmodel.json").write_text(json.dumps({"data": str(Path(args.data).relative_to(ROOT))
                                                    if Path(args.data).resolve().is_relative_to(ROOT) else args.data,
                                                    "tolerance": TOLERANCE, "rows": rows}, indent=1) + "\n")
    (out / "costmodel.md").write_text(_md(rows, source))
    for r in rows:
        print(f"{r['name']:24s} measured {r['measured_step_seconds']:7.3f}  estimated {r['estimated_step_seconds']:7.3f}"
              f"  ratio {r['ratio']:.2f}  host {r['estimated_host_link_seconds']:.2f}"
              f"  {'ok' if r['within_tolerance'] else 'OFF'}{'  (offload)' if r['offload'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
