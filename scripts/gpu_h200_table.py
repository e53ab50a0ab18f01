"""benchmarks/gpu_h200.{md,json} from the `jaxmem bench` JSON files of the H200 device runs of 2026-11-26
(benchmarks/bench_h200/run1: the code before that day's fixes; run2: after them; run3: a later session, after
the QLoRA base from the seed was built a layer at a time and the Pallas grouped matmul fitted its tiles to the
GPU's shared memory; run4: Mixtral-8x7B widths with `auto` now pallas on one GPU; run5: the grouped matmul at
five more shapes; run6: the Pallas backward reading an fp32 output gradient in bf16; run7, 2026-11-27: host
offload recipes, gpt-oss and Gemma 3 steps, and the Pallas kernels compiled for the GPU against their
references, scripts/gpu_kernel_numerics.py). Reads files, compiles nothing.

    python scripts/gpu_h200_table.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_grouped_matmul import kernel_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "bench_h200"
GIB = 2**30
WHAT = {  # case -> (what it is, the code it ran)
    ("run1", "bench_1b_s8k_sel_auto"): "Llama-3.2-1B, seq 8192, selective remat (calibration: same case as the H100 table)",
    ("run1", "bench_8bx8_s8k_full_auto"): "8B widths x 8 layers, seq 8192, full remat: lean step LOST on jax 0.11 "
                                          "(jaxpr walk could not read its scans)",
    ("run2", "bench_8bx8_s8k_full_auto"): "8B widths x 8 layers, seq 8192, full remat: lean step (walk fixed)",
    ("run1", "bench_qlora_8b_qv_s512"): "QLoRA Llama-3-8B nf4, q,v r32, seq 512, mb 2, no remat (base from seed)",
    ("run2", "bench_qlora_8b_qv_s512"): "same QLoRA, with the peak by the end of init recorded",
    ("run2", "bench_qwen3moe_x4_s8k_full"): "Qwen3-30B-A3B widths x 4 layers, seq 8192, full remat, "
                                            "grouped matmul blocked (default)",
    ("run2", "bench_qwen3moe_x4_s8k_full_pallas"): "same MoE step, kernels.grouped_matmul=pallas",
    ("run3", "bench_qlora_8b_qv_s512"): "same QLoRA 8B q,v, its nf4 base from the seed a layer at a time",
    ("run3", "bench_qwen3moe_x4_s8k_qlora_blocked"): "QLoRA Qwen3-30B-A3B widths x 4 layers, nf4, r16 all-linear "
                                                    "(experts too), seq 8192, full remat, grouped matmul blocked",
    ("run3", "bench_qwen3moe_x4_s8k_qlora_pallas"): "same MoE QLoRA step, kernels.grouped_matmul=pallas",
    ("run4", "bench_mixtral_x2_s8k_full_blocked"): "Mixtral-8x7B widths x 2 layers, seq 8192, full remat, "
                                                  "grouped matmul blocked",
    ("run4", "bench_mixtral_x2_s8k_full_auto"): "same Mixtral step, grouped matmul auto (pallas on one GPU)",
    ("run6", "bench_qwen3moe_x4_s8k_qlora_pallas"): "run3's MoE QLoRA pallas step, the kernel's backward reading the "
                                                   "adapters' fp32 output gradient in bf16 (losses within 4e-4 "
                                                   "of run3's)",
    ("run7", "bench_4090_8bx8_s4k"): "RTX 4090 recipe (params, master, m, v on the host, update streamed through "
                                     "the GPU) at 8B widths x 8 layers, seq 4096: the H100 table's row, with the "
                                     "host state built a layer at a time (38adf6e)",
    ("run7", "bench_gptoss_x2_s64k_qlora"): "gpt-oss-20b QLoRA recipe (nf4, r16 every linear, experts too; "
                                            "sinks through the Pallas flash kernel, 16384-token tiles) x 2 "
                                            "layers, seq 65536",
    ("run7", "bench_gemma3_x6_s8k_host"): "Gemma 3 12B recipe (master, m, v and the AdamW update on the host) x "
                                          "6 layers, seq 8192, Pallas attention at head_dim 256: the peak is the "
                                          "init's (the embedding's fp32 state built whole on the GPU)",
    ("run7", "bench_gemma3_x6_s8k_devupdate"): "same Gemma 3 step, offload.optimizer_update=device (the state "
                                               "streamed through the GPU)",
}


def rows():
    out = []
    for (run, name), what in WHAT.items():
        path = RUNS / run / f"{name}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        mem = r["memory"]
        init_peak = mem.get("peak_bytes_after_init", {}).get("value")
        out.append({
            "run": run, "case": name, "what": what, "device": r["device"]["kind"], "jax": r["compiled"]["jax"],
            "compiled_gib": mem["planned_device_bytes"]["value"] / GIB,
            "peak_gib": mem["measured_peak_bytes"]["value"] / GIB,
            "peak_after_init_gib": init_peak / GIB if init_peak else None,
            "step_s": r["step_time"]["measured_seconds"]["value"],
            "estimated_step_s": r["step_time"]["estimated_seconds"]["value"],
            "tokens_per_s": r["tokens_per_second"]["value"], "mfu": r["mfu"]["value"],
        })
    return out


def numerics_section() -> list[str]:
    """run7's kernel numerics (scripts/gpu_kernel_numerics.py): every case, then the fp32 case again against
    a reference at full fp32 precision."""
    first = json.loads((RUNS / "run7" / "kernel_numerics.json").read_text())
    again = json.loads((RUNS / "run7" / "kernel_numerics_fp32.json").read_text())["cases"]
    lines = ["", "## run7: the Pallas kernels compiled for the GPU against their references", "",
             f"`scripts/gpu_kernel_numerics.py` on one {first['device']}, jax {first['jax']}: each Pallas kernel "
             "compiled through Triton (the suite runs the same kernels interpreted on CPU) against its pure-jnp "
             "reference in fp32 on the same inputs, forward and every input gradient (fp32 output cotangent); "
             "error = max |err| / max |ref|, the worst output. Attention at 4096 tokens; the tolerance is the "
             "suite's per dtype (bf16: 2e-2 forward, 3e-2 gradients).", "",
             "| kernel case | forward err | gradient err | within tolerance | how |", "|---|---:|---:|---|---|"]
    for name, row in first["cases"].items():
        note = first["how"]
        if name in again:
            row, note = again[name], (f"{first['how']}; reference at fp32 'highest' precision, tolerance TF32's "
                                      f"({row['forward_err'][0]:.1e} / {max(row['grad_err']):.1e} against the "
                                      "GPU's default-precision reference, outside the fp32 tolerance 2e-5)")
        lines.append(f"| {name} | {max(row['forward_err']):.1e} | {max(row['grad_err']):.1e} | "
                     f"{'yes' if row['ok'] else 'no'} | measured on GPU ({note}) |")
    fp32 = next(iter(again.values()))
    bf16 = [row for name, row in first["cases"].items() if "bf16" in name]
    lines += ["", "An fp32 kernel's dots run in TF32 on the GPU (Triton's default, as XLA's default precision for "
              f"fp32 dots there): the fp32 attention is within {max(fp32['forward_err']):.1e} / "
              f"{max(fp32['grad_err']):.1e} of a full-precision reference, not the 2e-5 interpret mode reaches on "
              "CPU. Every bf16 case, Gemma 3's head_dim 256 with its 1024 window and gpt-oss's sinks with its 128 "
              f"window included, is within {max(max(r['forward_err']) for r in bf16):.1e} forward and "
              f"{max(max(r['grad_err']) for r in bf16):.1e} gradients.", ""]
    return lines


def main():
    table = rows()
    gmm = json.loads((RUNS / "run2" / "grouped_matmul_gpu.json").read_text())
    gmm3 = json.loads((RUNS / "run3" / "grouped_matmul_gpu.json").read_text())
    (ROOT / "benchmarks" / "gpu_h200.json").write_text(json.dumps(
        {"train_steps": table, "grouped_matmul": gmm, "grouped_matmul_run3": gmm3}, indent=1) + "\n")
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    lines = [
        "# jaxmem on one NVIDIA H200 (2026-11-26, run7 2026-11-27)",
        "",
        "Generated by `scripts/gpu_h200_table.py` from `jaxmem bench` JSON (`benchmarks/bench_h200/run*/`, made by",
        "`scripts/gpu_session.sh` on the lent device: jax 0.11.2 + CUDA plugin, Python 3.12, jaxmem from source).",
        "**measured on GPU**: peak = the allocator's `peak_bytes_in_use` after the steps (init included), step =",
        "median of 3 steps after 3 warm-ups; **compiled**: XLA's memory_analysis of the executable that ran",
        "(compiled on that GPU); **estimated**: the cost model (fitted on H100 steps). bf16 params and compute, fp32",
        "master and Adam moments, micro-batch 1 unless said. run1: the code at the start of the day; run2: after",
        "the day's fixes (lean gradients on jax 0.11, the blocked grouped matmul); run3: a later session's code (the",
        "QLoRA base from the seed a layer at a time; the Pallas grouped matmul's tiles fitted to shared memory).",
        "",
        "| run | case | compiled GiB | peak GiB (measured) | peak by end of init GiB | step s (measured) | step s "
        "(estimated) | tokens/s | MFU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(f"| {r['run']} | {r['what']} | {r['compiled_gib']:.2f} | {r['peak_gib']:.2f} | "
                     f"{fmt(r['peak_after_init_gib'], '.2f')} | {r['step_s']:.3f} | {fmt(r['estimated_step_s'], '.3f')} | "
                     f"{r['tokens_per_s']:,.0f} | {fmt(r['mfu'], '.1%')} |")
    lines += ["", "MFU counts the active parameters (the MoE rows: the top-k experts a token runs). "
              "step s (estimated): the cost model of the code that ran (run3's MoE rows before the grouped matmul "
              "had a rate of its own); "
              "benchmarks/costmodel.md gives today's model against every row.", "",
              "## Grouped matmul (the MoE experts), fwd + bwd, measured on GPU", "", gmm["note"] + ".", "",
              "| implementation | fwd temp GiB | fwd+bwd temp GiB | fwd ms | fwd+bwd ms | peak GiB | how |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for g in gmm["rows"]:
        if "error" in g:
            lines.append(f"| {g['impl']} | | | | | | failed: {g['error']} |")
        else:
            lines.append(f"| {g['impl']} | {g['fwd_temp_gib']:.2f} | {g['fwd_bwd_temp_gib']:.2f} | {g['fwd_ms']:.2f} | "
                         f"{g['fwd_bwd_ms']:.2f} | {g['peak_gib']:.2f} | {g['how']} |")
    lines += ["", "### run3: fp32, and the tiles fitted to smaller GPUs", "",
              "Same shape and script (`--dtypes bfloat16,float32 --impls blocked,pallas --tiles-for "
              "a100-80g,rtx4090-24g`). `tiles for X`: the Pallas kernel run on the H200 with the tiles and "
              "stages it fits to X's shared memory (A100 166 KiB, RTX 4090 99 KiB per block), which tells what "
              "the smaller tiles cost on this GPU, not X's own speed.", "",
              *kernel_table(gmm3["kernel"], how=False)]
    lines.append(f"\nAll rows: {gmm3['kernel'][0]['how'].split(';')[0].split(' (')[0]} "
                 f"({gmm3['kernel'][0]['device']}, jax {gmm3['kernel'][0]['jax']}); temp: compiled for that GPU.")
    lines += ["", "### run5: the grouped matmul by shape (bf16)", "",
              "Same script, `--shape ROWS,D,F,GROUPS --impls blocked,pallas`, rows routed uniformly at random. "
              "Rate = active FLOPs (6 x rows x D x F) / time / 989 TFLOP/s: the cost model's "
              "GROUPED_MATMUL_EFFICIENCY_BY_SHAPE (with run3's 65536-row Qwen3 shape).", "",
              "| rows, D, F, experts | rows per expert | blocked ms | pallas ms | blocked rate | pallas rate |",
              "|---|---:|---:|---:|---:|---:|"]
    for path in sorted(RUNS.glob("run5/grouped_matmul_*.json"), key=lambda f: json.loads(f.read_text())["shape"]):
        sweep = json.loads(path.read_text())
        rows_, d, f, groups = sweep["shape"]
        ms = {k["impl"]: k["fwd_bwd_ms"] for k in sweep["kernel"] if "fwd_bwd_ms" in k}
        rate = {impl: 6 * rows_ * d * f / (t * 1e-3) / 989e12 for impl, t in ms.items()}
        lines.append(f"| {rows_}, {d}, {f}, {groups} | {rows_ // groups} | {ms['blocked']:.2f} | {ms['pallas']:.2f} "
                     f"| {rate['blocked']:.3f} | {rate['pallas']:.3f} |")
    again = {k["impl"]: k["fwd_bwd_ms"] for k in json.loads((RUNS / "run4" / "grouped_matmul_gpu.json").read_text())[
        "kernel"] if "fwd_bwd_ms" in k}
    first = {k["impl"]: k["fwd_bwd_ms"] for k in gmm3["kernel"] if k["dtype"] == "bfloat16" and not k.get("tiles_for")}
    lines += ["", "Run to run: run4 timed run3's bf16 Qwen3 shape again, blocked " + f"{again['blocked']:.2f} ms "
              f"(run3 {first['blocked']:.2f}), pallas {again['pallas']:.2f} ms (run3 {first['pallas']:.2f})."]
    ragged = json.loads((RUNS / "run1" / "ragged.json").read_text())
    lines += ["", "ragged_dot alone on the same GPU (`scripts/gpu_ragged_probe.py`, run1): " + "; ".join(
        f"{r['M']} rows: {r['temp_gib']:.1f} GiB temp compiled" + (f", fwd+bwd {r['fwd_bwd_ms']:.1f} ms measured"
                                                                 if "fwd_bwd_ms" in r else "") for r in ragged) + ".",
              "", "A run1 MoE case (Qwen3-30B-A3B widths x 2 layers, seq 4096, ragged_dot) ran out of memory on the",
              "H200: `Out of memory while trying to allocate 68.15GiB` (`benchmarks/bench_h200/run1/bench_qwen3moe_x2_s4k_full.txt`).", ""]
    lines += numerics_section()
    (ROOT / "benchmarks" / "gpu_h200.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
