"""Kernel figures: measured on an H100, compiled for one H100 80GB (deviceless), and estimated.

Writes benchmarks/kernels.json and benchmarks/kernels.md. Measured: the JSON lines that
`scripts/bench_kernels_gpu.py` wrote on a GPU (benchmarks/kernels_gpu.jsonl). Compiled: memory figures
from `compiled.memory_analysis()` of programs compiled for h100-80g on this CPU machine. Estimated:
roofline times from the kernels' own pl.CostEstimate. Every table says which.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxmem.runtime.aot import compile_abstract, target_devices  # noqa: E402
from jaxmem.config import KernelConfig  # noqa: E402
from jaxmem.kernels import loss_blocks  # noqa: E402
from jaxmem.kernels.attention.pallas import attention_cost, flash_attention  # noqa: E402
from jaxmem.kernels.attention.reference import attention_reference  # noqa: E402
from jaxmem.kernels.cross_entropy import chunked, pallas as pallas_ce  # noqa: E402
from jaxmem.kernels.cross_entropy.reference import linear_cross_entropy_reference  # noqa: E402
from jaxmem.kernels.rms_norm.pallas import rms_norm, rms_norm_cost  # noqa: E402
from jaxmem.kernels.rms_norm.reference import rms_norm_reference  # noqa: E402
from jaxmem.plan.compiled import memory_figures  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "benchmarks"
HOW = "compiled for h100-80g (deviceless)"
H100_FLOPS, H100_BYTES_PER_S = 989e12, 3.35e12  # dense bf16 peak, HBM3 bandwidth (published)
T, D, V = 8192, 4096, 128256
LLAMA3_8B = dict(n=32, kv=8, h=128)
GIB = 2**30
H100_HBM_BYTES = 84929347584  # device_memory_size of the h100-80g target
PUBLISHED = [
    {"what": "Liger fused linear cross-entropy, hidden 4096, vocab 128256, 8192 tokens, bf16", "peak_gb": 4.5,
     "how": "published (Liger-Kernel), measured on A100 with PyTorch"},
    {"what": "unfused PyTorch linear + cross-entropy, same shapes", "peak_gb": 9.2,
     "how": "published (Liger-Kernel), measured on A100 with PyTorch"},
    {"what": "Cut Cross-Entropy (Wijmans et al.), loss + grad", "peak_gb": 1.1, "how": "published (CCE paper)"},
]


def _device():
    return jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])


def _memory(fn, *args) -> dict:
    start = time.perf_counter()
    f = memory_figures(compile_abstract(fn, *args))
    return {"argument_bytes": f["argument"], "output_bytes": f["output"],
            "alias_bytes": f["alias"], "temp_bytes": f["temp"], "device_bytes": f["device"],
            "compile_s": round(time.perf_counter() - start, 1), "how": HOW}


def loss_memory() -> dict:
    s = _device()
    args = (jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((D, V), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((T,), jnp.int32, sharding=s))
    blocks = loss_blocks(KernelConfig())
    impls = {
        "naive": linear_cross_entropy_reference,
        "chunked": lambda h, w, l: chunked.linear_cross_entropy(h, w, l, blocks=blocks),
        "pallas": lambda h, w, l: pallas_ce.linear_cross_entropy(h, w, l, blocks=blocks),
    }
    out = {}
    for name, fn in impls.items():
        step = lambda h, w, l, fn=fn: jax.value_and_grad(lambda h, w: fn(h, w, l)[0], (0, 1))(h, w)
        out[name] = _memory(step, *args)
        print(f"loss {name}: {out[name]['device_bytes'] / GIB:.2f} GiB device, "
              f"{out[name]['temp_bytes'] / GIB:.3f} GiB temp", flush=True)
    return out


def attention_memory(seqs=(8192, 32768)) -> dict:
    s = _device()
    out = {}
    for seq in seqs:
        spec = lambda heads: jax.ShapeDtypeStruct((1, seq, heads, LLAMA3_8B["h"]), jnp.bfloat16, sharding=s)
        args = (spec(LLAMA3_8B["n"]), spec(LLAMA3_8B["kv"]), spec(LLAMA3_8B["kv"]), spec(LLAMA3_8B["n"]))
        for name, fn in (("xla", lambda q, k, v: attention_reference(q, k, v)), ("pallas", flash_attention)):
            def fwd_bwd(q, k, v, ct, fn=fn):
                out, vjp = jax.vjp(fn, q, k, v)
                return out, vjp(ct)

            out[f"{name}@{seq}"] = dict(_memory(fwd_bwd, *args), impl=name, seq=seq)
            print(f"attention {name} seq {seq}: {out[f'{name}@{seq}']['device_bytes'] / GIB:.2f} GiB", flush=True)
    return out


def norm_memory() -> dict:
    s = _device()
    args = (jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((D,), jnp.bfloat16, sharding=s),
            jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=s))
    out = {}
    for name, fn in (("xla", rms_norm_reference), ("pallas", rms_norm)):
        def fwd_bwd(x, w, ct, fn=fn):
            y, vjp = jax.vjp(fn, x, w)
            return y, vjp(ct)

        out[name] = _memory(fwd_bwd, *args)
    return out


STEP_BASE = ["model.preset=llama3-8b", "train.seq_len=8192", "train.micro_batch=1", "remat.preset=full",
             "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"]
STEP_CASES = {
    "xla (naive loss, xla attention, xla norm), fsdp=8": ["kernels.loss=naive", "kernels.attention=xla",
                                                          "kernels.norm=xla"],
    "auto (here: chunked loss, pallas attention (no cuDNN library), xla norm), fsdp=8": [
        "kernels.loss=auto", "kernels.attention=auto", "kernels.norm=auto"],
    "chunked loss, pallas attention, pallas norm, fsdp=8": ["kernels.loss=chunked", "kernels.attention=pallas",
                                                            "kernels.norm=pallas"],
    "pallas loss, attention and norm, fsdp=8": ["kernels.loss=pallas", "kernels.attention=pallas",
                                                "kernels.norm=pallas"],
    "xla, fsdp=4 x tp=2": ["kernels.loss=naive", "kernels.attention=xla", "kernels.norm=xla", "parallel.fsdp=4",
                           "parallel.tp=2", "parallel.rules=fsdp_tp"],
    "pallas loss, attention + norm, fsdp=4 x tp=2": ["kernels.loss=pallas", "kernels.attention=pallas",
                                                     "kernels.norm=pallas", "parallel.fsdp=4", "parallel.tp=2",
                                                     "parallel.rules=fsdp_tp"],
}


def train_step_memory() -> dict:
    """The whole jaxmem train step (llama3-8b, seq 8192, micro-batch 1/device, full remat, bf16) per kernel choice."""
    from jaxmem.loader import load_config
    from jaxmem.registry import build_program

    devices = target_devices("h100-80g", 8)
    out = {}
    for name, overrides in STEP_CASES.items():
        prog = build_program(load_config(None, STEP_BASE + overrides), devices=devices)
        start = time.perf_counter()
        f = memory_figures(prog.lower().compile())
        total = f["device"]
        out[name] = {"overrides": STEP_BASE + overrides, "device_bytes": total, "temp_bytes": f["temp"],
                     "compile_s": round(time.perf_counter() - start, 1),
                     "how": "compiled for 8 x h100-80g (deviceless)"}
        print(f"step {name}: {total / GIB:.2f} GiB per device", flush=True)
    return out


def _roofline(cost) -> dict:
    compute_s, memory_s = cost.flops / H100_FLOPS, cost.bytes_accessed / H100_BYTES_PER_S
    return {"flops": cost.flops, "bytes_accessed": cost.bytes_accessed, "transcendentals": cost.transcendentals,
            "estimated_h100_ms": round(1e3 * max(compute_s, memory_s), 3),
            "bound": "compute" if compute_s >= memory_s else "memory",
            "how": "kernel's own pl.CostEstimate; time estimated from the H100 roofline (989 TFLOP/s, 3.35 TB/s)"}


def costs() -> dict:
    blocks = loss_blocks(KernelConfig())
    n, h = LLAMA3_8B["n"], LLAMA3_8B["h"]
    return {
        "cross_entropy_fwd (pallas logsumexp kernel)": _roofline(pallas_ce.forward_cost(T, D, V, 2, blocks)),
        "flash_attention_fwd seq 8192": _roofline(attention_cost(1, 8192, 8192, n, h, 2)),
        "flash_attention_dq seq 8192": _roofline(attention_cost(1, 8192, 8192, n, h, 2, matmuls=3)),
        "flash_attention_dkv seq 8192": _roofline(attention_cost(1, 8192, 8192, n, h, 2, matmuls=4, passes=2)),
        "rms_norm_fwd 8192x4096": _roofline(rms_norm_cost(T, D, 2)),
        "rms_norm_bwd 8192x4096": _roofline(rms_norm_cost(T, D, 2, backward=True)),
    }


def _gib(x) -> str:
    return f"{x / GIB:.2f}"


GPU_RUNS = OUT / "kernels_gpu.jsonl"
DROPPED_LOSSES = [  # (what, setting, fwd+bwd ms, temp GiB, source): backward designs measured and dropped
    ("pallas, backward: one kernel with atomic adds of dh and dW", "128 x 128 x 64", 733.0, 0.38,
     "measured on GPU, 2026-11-22 (benchmarks/gpu_h100.md)"),
    ("pallas, backward: Pallas dlogits kernel per vocab slab + two cuBLAS matmuls", "256 x 128 x 64, slab 4096",
     76.6, 0.25, "measured on GPU, 2026-11-23 (kernels_gpu.jsonl run 5)"),
]


DESIGN_NOTES = [
    "### What the measurements decided",
    "",
    "- **Chunked loss tiles by shape** (`kernels.loss_block_t/v = 0`): every local token in one tile (up to",
    "  8192 x 2048 elements) and 2048-column vocab slabs. 0.81x the naive loss's time at 0.22 GiB of scratch,",
    "  against 1.12x for the old 1024 x 4096 default: fewer, larger matmuls, and W is read once per token tile.",
    "- **The Pallas loss** (`kernels.loss=pallas`) was rebuilt without atomics: a forward kernel whose grid",
    "  covers token blocks x vocab splits (the splits' logsumexps combined outside) with 256 x 128 x 64 tiles,",
    "  and the chunked loss's tiled cuBLAS backward. **62.4 ms against 64.3 ms for chunked in the same",
    "  session (0.97x chunked, 0.79x naive), 0.22 GiB of scratch**: the issue's goal (<= 65 ms, at least as",
    "  fast as chunked) is met at this shape. The forward is where it wins (14.9 vs 17.5 ms). Tried and",
    "  dropped for the backward: a Pallas kernel writing each vocab slab's dlogits in bf16 followed by two",
    "  cuBLAS matmuls (62 ms of backward against chunked's 47: the Triton logits matmul runs at ~60% of",
    "  the peak, cuBLAS at ~80%), and the previous single kernel with atomic adds (733 ms). 256-token tiles",
    "  were the best forward tiles (128: 19.7 ms; 512 x 64: 22.6 ms); more warps, stages or a 32-wide inner",
    "  step were slower. `auto` stays chunked: the gain is 3% at one shape on one GPU (the kernel compiles",
    "  for sm_89 too, deviceless, but was timed only on the H100). One kernel for all",
    "  three matmuls is not the route: a program that owns a dh or dW tile needs the full-D logits of every",
    "  tile it touches, so it would recompute them D / 128 times.",
    "- **The jax-triton loss was dropped**: Pallas lowers to the same Triton, the extra dependency pinned a",
    "  Triton version the GPU image did not have, and it measured 1384 ms (2026-11-22).",
    "- **Attention**: cuDNN is `auto` on NVIDIA GPUs: 1.5x (seq 8192) and 1.55x (seq 32768) faster than the",
    "  best Pallas tiles measured. Route for the Pallas kernel: docs/attention.md.",
    "",
]


def gpu_rows() -> list[dict]:
    """The measured rows of shipped code (benchmarks/kernels_gpu.jsonl), errors and reverted variants left out."""
    if not GPU_RUNS.exists():
        return []
    rows = [json.loads(line) for line in GPU_RUNS.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("shipped") and "fwd_bwd_ms" in r]


def gpu_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return ["## Measured on a GPU", "", "No GPU measurements in benchmarks/kernels_gpu.jsonl: the speed goals",
                "were not measured.", ""]
    device, jax_version = rows[0]["device"], rows[0]["jax"]
    naive = next(r["fwd_bwd_ms"] for r in rows if r["case"] == "ce_naive")
    lines = [f"## Measured on a GPU ({device}, jax {jax_version})", "",
             "Every time in this section was **measured on GPU** by `scripts/bench_kernels_gpu.py` (median of 10",
             "calls after 2 warm-ups, each synchronized); temp is XLA's compiled temp on that GPU. Raw rows, with",
             "the variants that were tried and reverted: `benchmarks/kernels_gpu.jsonl`.", "",
             f"### LM head + cross-entropy, forward + backward (T={T}, D={D}, V={V}, bf16)", "",
             "| implementation | setting | fwd+bwd ms | x naive | fwd ms | temp GiB | rel. error dh / dW vs fp32 |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in sorted((r for r in rows if r["case"].startswith("ce_")), key=lambda r: r["fwd_bwd_ms"]):
        err = f"{r['dh_rel']:.1e} / {r['dw_rel']:.1e}" if "dh_rel" in r else ""
        lines.append(f"| {r['case'].split('@')[0][3:]} | {r['setting']} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['fwd_bwd_ms'] / naive:.2f} | {r['fwd_ms']:.1f} | {r['temp_gib']:.2f} | {err} |")
    lines += [f"| {what} (dropped) | {setting} | {ms:.1f} | {ms / naive:.2f} | | {temp:.2f} | {how} |"
              for what, setting, ms, temp, how in DROPPED_LOSSES] + [""]
    lines += ["### Attention forward + backward (B=1, 32 q heads, 8 kv heads, head_dim 128, causal, bf16)", "",
              "| seq | implementation | setting | fwd+bwd ms | TFLOP/s (causal) | temp GiB | x cuDNN speed |",
              "|---:|---|---|---:|---:|---:|---:|"]
    attention = [r for r in rows if r["case"].startswith("attn_")]
    for seq in sorted({int(r["case"].split("@")[0].split("_")[2]) for r in attention}):
        at = sorted((r for r in attention if int(r["case"].split("@")[0].split("_")[2]) == seq),
                    key=lambda r: r["fwd_bwd_ms"])
        cudnn = next((r["fwd_bwd_ms"] for r in at if r["case"].startswith("attn_cudnn")), None)
        for r in at:
            ratio = f"{cudnn / r['fwd_bwd_ms']:.2f}" if cudnn else ""
            lines.append(f"| {seq} | {r['case'].split('_')[1]} | {r['setting']} | {r['fwd_bwd_ms']:.2f} | "
                         f"{r['tflops_per_s']:.0f} | {r['temp_gib']:.3f} | {ratio} |")
    return lines + [""]


def markdown(result: dict) -> str:
    loss = result["loss"]
    naive = loss["naive"]["device_bytes"]
    lines = [
        "# Kernels: measured speed, compiled memory, estimated cost",
        "",
        "Generated by `scripts/bench_kernels.py`. Three kinds of figures, each table labeled: **measured on",
        "GPU** (first section), **compiled for h100-80g (deviceless)** (memory, from `compiled.memory_analysis()`,",
        "device bytes = argument + output - alias + temp) and **estimated** (roofline from each kernel's own",
        "`pl.CostEstimate`, last section).",
        "",
        *gpu_markdown(gpu_rows()),
        *DESIGN_NOTES,
        "",
        f"## LM head + cross-entropy, loss and grads of h and W (T={T}, D={D}, V={V}, bf16)",
        "",
        "| implementation | device GiB | temp GiB | temp vs naive | how |",
        "|---|---:|---:|---:|---|",
    ]
    for name, m in loss.items():
        lines.append(f"| {name} | {_gib(m['device_bytes'])} | {_gib(m['temp_bytes'])} | "
                     f"{m['temp_bytes'] / loss['naive']['temp_bytes']:.3f}x | {m['how']} |")
    fixed = loss["pallas"]["argument_bytes"] + loss["pallas"]["output_bytes"]
    lines += [
        "",
        f"Arguments (h, W, labels) plus outputs (loss, dh, dW) alone are {_gib(fixed)} GiB for every",
        "implementation (W and dW are 1 GiB each in bf16), so the target `<= 1 GiB` and `<= 0.1x naive`",
        "applies to what the loss adds on top: the temp column. Device-total ratio fused/naive: "
        f"{loss['pallas']['device_bytes'] / naive:.3f} (pallas), {loss['chunked']['device_bytes'] / naive:.3f} "
        "(chunked).",
        "",
        "Published comparison figures (not reproduced here, different framework and GPU):",
        "",
    ]
    lines += [f"- {p['what']}: {p['peak_gb']} GB, {p['how']}" for p in PUBLISHED]
    lines += ["", "## Attention forward + backward, llama3-8b heads (32 q, 8 kv, head_dim 128), batch 1, bf16", "",
              "| seq | XLA GiB | Pallas flash GiB | how |", "|---:|---:|---:|---|"]
    att = result["attention"]
    for seq in sorted({v["seq"] for v in att.values()}):
        xla = att[f"xla@{seq}"]["device_bytes"]
        over = " (over the 80 GB HBM)" if xla > H100_HBM_BYTES else ""
        lines.append(f"| {seq} | {_gib(xla)}{over} | {_gib(att[f'pallas@{seq}']['device_bytes'])} | {HOW} |")
    lines += ["", "A compile never fails for lack of memory: above the HBM size XLA's rematerialization pass",
              "logs that it cannot reduce memory below its limit and the program would not fit on the GPU.",
              "cuDNN attention (`kernels.attention=cudnn`) needs the cuDNN library to lower, so it is not",
              "compiled here.", "", f"## RMSNorm forward + backward ({T}x{D}, bf16)", "",
              "| implementation | device GiB | temp GiB | how |", "|---|---:|---:|---|"]
    for name, m in result["rms_norm"].items():
        lines.append(f"| {name} | {_gib(m['device_bytes'])} | {_gib(m['temp_bytes'])} | {m['how']} |")
    lines += ["", "## Whole train step per device: llama3-8b, 8 x H100, seq 8192, micro-batch 1, full remat, bf16",
              "", "| kernels | device GiB | temp GiB | how |", "|---|---:|---:|---|"]
    for name, m in result["train_step"].items():
        lines.append(f"| {name} | {_gib(m['device_bytes'])} | {_gib(m['temp_bytes'])} | {m['how']} |")
    lines += ["", "`auto` picks what the measured table at the top favours: the chunked loss (fastest, at the",
              "same scratch), cuDNN attention on NVIDIA GPUs (Pallas for packed documents, or where the cuDNN",
              "library is missing, as on this CPU machine), and XLA's RMSNorm (XLA fuses the norm itself; the",
              "Pallas norm saved no bytes in the compiled step and was 2x slower on the H100).",
              "", "## FLOPs and bytes per kernel call (estimated)", "",
              "| kernel | GFLOP | GB moved | estimated H100 ms | bound |", "|---|---:|---:|---:|---|"]
    for name, c in result["costs"].items():
        lines.append(f"| {name} | {c['flops'] / 1e9:.1f} | {c['bytes_accessed'] / 1e9:.2f} | "
                     f"{c['estimated_h100_ms']} | {c['bound']} |")
    lines += ["", "FLOPs and bytes come from the kernels' own `pl.CostEstimate` (the numbers XLA's scheduler",
              "sees); the time is max(FLOPs / 989 TFLOP/s, bytes / 3.35 TB/s): an estimate, not a measurement.",
              "Against the measured table: the Pallas loss's forward estimate is 8.7 ms and it took 14.9 ms (58% of",
              "the bf16 peak).", ""]
    return "\n".join(lines)


def main():
    if "--markdown-only" in sys.argv:  # re-render kernels.md from kernels.json
        (OUT / "kernels.md").write_text(markdown(json.loads((OUT / "kernels.json").read_text())))
        return
    result = {"target": "h100-80g", "jax": jax.__version__, "loss": loss_memory(), "attention": attention_memory(),
              "rms_norm": norm_memory(), "train_step": train_step_memory(), "costs": costs(), "published": PUBLISHED}
    OUT.mkdir(exist_ok=True)
    (OUT / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "kernels.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
