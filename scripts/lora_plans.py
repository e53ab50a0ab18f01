"""LoRA / QLoRA plans, compiled deviceless: issue 27's everyday recipes (Llama-3-8B QLoRA, seq 512, no remat,
one 24 GB GPU) and, for each model, GPU and base dtype, the longest sequence that fits one GPU. Writes
benchmarks/lora.json and benchmarks/lora.md.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/lora_plans.py [--from-json | --recipes-only]

--recipes-only compiles the recipes and takes the longest-sequence rows from benchmarks/lora.json.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks"
GIB = 1024**3
Q8, Q70 = "configs/lora/llama3-8b-qlora-1x4090.yaml", "configs/lora/llama3-70b-qlora-1xh100.yaml"
Q70_L40S = "configs/lora/llama3-70b-qlora-1xl40s.yaml"
H100 = ["target.name=h100-80g"]
L40S = ["target.name=l40s-48g"]
BF16_BASE = ["lora.base_dtype=bfloat16", "lora.double_quant=false"]

# (row, config, overrides, sequence lengths to probe in order, the goal it answers)
ROWS = [
    ("Llama-3-8B LoRA (bf16 base), 1 x RTX 4090 24GB", Q8, BF16_BASE, [4096, 8192, 16384, 32768, 65536, 131072],
     ""),
    ("Llama-3-8B QLoRA (nf4), 1 x RTX 4090 24GB", Q8, [], [8192, 16384, 32768, 65536, 131072, 262144],
     "seq 8192 with >= 10% headroom"),
    ("Llama-3-8B LoRA (bf16 base), 1 x H100 80GB", Q8, BF16_BASE + H100,
     [131072, 262144, 524288, 1048576, 2097152], ""),
    ("Llama-3-8B QLoRA (nf4), 1 x H100 80GB", Q8, H100, [262144, 524288, 1048576, 2097152],
     "seq >= 1,048,576 (Unsloth: 342,000)"),
    ("Llama-3-70B QLoRA (nf4), 1 x H100 80GB", Q70, [], [65536, 131072, 196608, 262144, 393216, 524288],
     "seq >= 131,072 (Unsloth: 89,389 on an 80 GB A100)"),
    ("Llama-3-70B QLoRA (nf4), 1 x L40S 48GB", Q70, L40S, [8192, 16384, 32768, 65536],
     "(QLoRA paper: a 65B model on one 48 GB GPU)"),
    ("Llama-3-70B QLoRA (nf4), 1 x L40S 48GB, adapter optimizer state on the host", Q70,
     L40S + ["offload.optimizer=host", "offload.optimizer_update=device"], [2048, 4096, 8192], ""),
    ("Llama-3-70B QLoRA (nf4, embedding + LM head in nf4 too), 1 x L40S 48GB, adapter optimizer state on the "
     "host, bf16 adapter gradients", Q70_L40S, [], [2048, 4096, 8192, 12288, 16384],
     "(QLoRA paper: a 65B model on one 48 GB GPU; Unsloth: 12,106 tokens for Llama-3.3-70B on 48 GB)"),
    ("the same in 4096-token sequence tiles (the MLP's [T, d_ff] values a tile at a time; the tiles' forward "
     "runs once more in the backward)", Q70_L40S, ["remat.seq_tile=4096"], [16384, 32768, 49152],
     "Unsloth: 12,106 tokens for Llama-3.3-70B on 48 GB (measured; class in the text below)"),
]


# (recipe, config, the figures before issue 27's change (merged W + s A B in the layer scan, only the targeted
# linears quantized; compiled deviceless with jax 0.10.2 at commit 2e38dd8, the same configs), the goal)
RECIPES = [
    ("Llama-3-8B QLoRA, all linears", "configs/lora/llama3-8b-qlora-all-linear-seq512.yaml",
     "27.74 (bill then 17.17) | 14.64 (argument 6.40 + temp 8.24)", "<= 10"),
    ("Llama-3-8B QLoRA, q,v only (LitGPT's recipe; LitGPT measured 17.41 GB = 16.21 GiB on an A10G)",
     "configs/lora/llama3-8b-qlora-qv-seq512.yaml", "21.99 (bill then 24.71) | 12.12 (argument 5.49 + temp 6.63)",
     "<= 10"),
]


def _recipe_record(p: dict) -> dict:
    c, a = p["compiled"], p["analytic"]
    return {"device_total": c["device_total"], "argument": c["argument"], "temp": c["temp"], "label": c["label"],
            "jax": c.get("jax"), "analytic": a["device_total"], "model_flops": p["cost"]["model_flops"]}


def _recipe_md(name: str, before: str, goal: str, r: dict) -> str:
    total, bill = r["device_total"] / GIB, r["analytic"] / GIB
    verdict = "met" if total <= float(goal.split()[-1]) else "missed"
    parts = f"argument {r['argument'] / GIB:.2f} + temp {r['temp'] / GIB:.2f}"
    return (f"| {name} | {before} | **{total:.2f}** ({parts}) | "
            f"{bill:.2f} ({total / bill:.3f}) | {r['model_flops']:.3g} | {goal}: {verdict} |")


def _seq_overrides(seq: int, overrides: list[str]) -> list[str]:
    """The length, and 8192-token sequence tiles from 32768 on unless the row names its own tile."""
    tile = [] if any(o.startswith("remat.seq_tile=") for o in overrides) else \
        [f"remat.seq_tile={8192 if seq >= 32768 else 0}"]
    return [f"train.seq_len={seq}", f"model.max_seq_len={max(seq, 8192)}", *tile]


def _plan(config: str, overrides: list[str]) -> dict:
    from jaxmem.loader import load_config
    from jaxmem.plan import plan, resolve_topology

    cfg = load_config(ROOT / config, overrides)
    return plan(cfg, resolve_topology(cfg), compile=True, source=config)


def probe(config: str, overrides: list[str], seqs: list[int]) -> list[dict]:
    """Plans each length in order until one does not fit; one record per length planned."""
    out = []
    for seq in seqs:
        p = _plan(config, overrides + _seq_overrides(seq, overrides))
        c = p["compiled"]
        out.append({"seq": seq, "device_total": c["device_total"], "host_total": c["host_total"],
                    "fits": p["fits"], "host_fits": p["host_fits"], "usable": p["usable_device_bytes"],
                    "capacity": p["target"]["device_memory_bytes"], "label": c["label"],
                    "step_seconds": p["cost"]["step_seconds"], "bill_base": p["analytic"]["base"],
                    "bill_params": p["analytic"]["params"], "bill_opt": p["analytic"]["opt_m"] * 2
                    + p["analytic"]["master"], "bill_grads": p["analytic"]["grads"]})
        print(f"  {seq}: {c['device_total'] / GIB:.2f} GiB, fits={p['fits']}", flush=True)
        if not (p["fits"] and p["host_fits"] is not False):
            break
    return out


def _row_md(name: str, config: str, overrides: list[str], goal: str, probes: list[dict]) -> str:
    fitting = [r for r in probes if r["fits"] and r["host_fits"] is not False]
    best = fitting[-1] if fitting else None
    nxt = next((r for r in probes if not r["fits"] or r["host_fits"] is False), None)
    if best is None:
        return f"| {name} | - | does not fit at {probes[0]['seq']:,} ({probes[0]['device_total'] / GIB:.1f} GiB) | | | {goal} |"
    headroom = 1 - best["device_total"] / best["capacity"]
    beyond = f"{nxt['seq']:,}: {nxt['device_total'] / GIB:.1f} GiB" if nxt else "not probed further"
    split = (f"base {best['bill_base'] / GIB:.1f}, adapters {best['bill_params'] / GIB:.2f}, adapter grads "
             f"{best['bill_grads'] / GIB:.2f}, adapter optimizer {best['bill_opt'] / GIB:.2f}")
    return (f"| {name} | **{best['seq']:,}** | **{best['device_total'] / GIB:.2f}** ({headroom:.0%} of the GPU free) | "
            f"{beyond} | {split} | {goal} |")


NOTES = """How to read it: **device GiB** is XLA's memory analysis of the real LoRA train step compiled for the
GPU (deviceless, on this CPU-only machine); the split into base / adapters / adapter gradients / adapter
optimizer state is the analytic bill's (estimated, device bytes: 0 where that state is on the host). Every
row uses the levers in its config (`configs/lora/`): rank 32 on all seven projections (alpha 32), NF4 base
with double-quantized scales for QLoRA (bf16 for LoRA), bf16 compute with fp32 master adapters, micro-batch
1, layer inputs offloaded to host memory, sequence tiling (8192 tokens) from 32K up, Pallas flash attention
and the chunked loss. The last row is `configs/lora/llama3-70b-qlora-1xl40s.yaml`: also the frozen embedding
table and LM head in NF4 (`lora.quantize_embeddings`, 1.0 GiB in place of 3.9), the adapters' optimizer
state and fp32 master on the host (`offload.optimizer=host`) and the adapter gradients in bf16
(`precision.grad_reduce_dtype=bfloat16`). Sequence lengths were probed in the order listed in
`scripts/lora_plans.py`; "longest that fits" is the longest probed length whose compiled figure is within
the usable memory (90% of the GPU). Nothing here was measured on a GPU, and the Unsloth / QLoRA figures
are theirs, measured on their GPUs.

What stops the next length (`jaxmem explain`, compiled for the target, deviceless): for the 8B rows on an
H100 the per-layer working set of [T, 4096] bf16 values while the base is fixed (at 1,048,576 tokens 8 GiB
each: the layer input, q, the attention output, the flash kernel's output and their cotangents; they double
at 2,097,152).
The sequence tiler writes its tiles into one buffer per output and the input cotangents over the output
cotangents, with no zero buffer shared between loops (`jaxmem/model/seq_tiling.py`): at 1,048,576 tokens that
took Llama-3-8B QLoRA from 76.9 to 55.7 GiB. Llama-3-70B on a 48 GB GPU fits 8,192 tokens untiled; at
12,288 (40.7 GiB against 40.5 usable) the peak is the MLP of one layer's backward: the [T, d_ff] gate / up /
activation values (672 MiB each) on top of the 33.9 GiB NF4 base. In 4096-token sequence tiles (the last row)
they exist a tile at a time: 32,768 tokens at 39.9 GiB. Unsloth reports 12,106 tokens for Llama-3.3-70B on
48 GB, measured; class: both 4-bit QLoRA with activation checkpoints in host memory and a chunked loss; ours
also stores the embedding and LM head in NF4 and the adapters' optimizer state on the host, and its tiles rerun
their forward in the backward (counted in the step time).

Not built yet: `lora.quantize_embeddings` with more than one device (the sharded loss takes a
plain head)."""


RECIPE_HEAD = """## QLoRA as users write it: Llama-3-8B, seq 512, micro-batch 2, no remat, one 24 GB GPU

Issue 27's recipes, `configs/lora/llama3-8b-qlora-all-linear-seq512.yaml` and
`configs/lora/llama3-8b-qlora-qv-seq512.yaml` (LitGPT's `llama-3-8b/qlora.yaml`: rank 32 on q and v): nf4 +
double quant, rank 32, alpha 16, bf16 params and compute with fp32 master adapters, `remat.preset: none`,
default kernels (Pallas flash attention, chunked loss), target `rtx4090-24g`. Device GiB per GPU, compiled
deviceless with jax 0.10.2 (`jaxmem plan <config>`) on this CPU-only machine; nothing here ran on a GPU."""

RECIPE_NOTES = """LitGPT publishes a measured 17.41 GB (16.21 GiB) peak for the q,v recipe on an A10G 24 GB (its
`config_hub/finetune/README.md`). That is a measurement on a GPU through PyTorch's caching allocator, and ours is
a compiled figure: the q,v compile is 0.56x it, a comparison of the same recipe (no recompute, no offload) across
classes of figure.

What changed (`jaxmem/lora/linear.py`): each projection computes x W + scale * (x A) B. W is dequantized under a
save-nothing checkpoint and `stop_gradient`, so the backward keeps only the stored nf4 slice (the layer scan
forwards it, no copy), and no merged weight or weight gradient exists. Every frozen linear is nf4, adapted or not:
the q,v base was 14.03 GiB with five bf16 projections and is now 5.31 GiB, with the embedding and LM head still
in bf16. The cost model's model FLOPs are 4 N T + 6 N_adapters T + attention, against 4.6e13 (6 N T) for a full
fine-tune of the same tokens: 0.69x to 0.70x.

Lean residuals (`jaxmem/model/gated.py`, `jaxmem/kernels/rms_norm/lean.py`): with `remat.preset: none`
autodiff kept, per layer of 1,024 tokens, six (q,v: five) [tokens, d_ff] bf16 values of 28 MiB (gate, up,
their product and three SiLU internals) and fp32 copies of the two norm inputs. The gated activation
act(gate) * up now has a custom VJP that keeps only gate and up and recomputes act(gate) and its derivative
elementwise in the backward; the default (XLA) RMSNorm has one that keeps its input in bf16 and recomputes
1/rms in the backward. Both are the same forward, and their gradients equal plain autodiff of the reference
(tests/integration/test_lean_residuals.py). Over 32 layers that drops 2.63 GiB of SiLU internals and 0.5 GiB of fp32 norm
copies: all linears 14.64 -> 11.52 GiB, q,v 12.12 -> 9.01 GiB (compiled deviceless for rtx4090-24g, jax
0.10.2); the adapters differentiated at bf16 (no fp32 copy of them, docs/lora.md) then took them to 11.04 and
8.86 GiB. Cost: one more elementwise pass over [tokens, d_ff] (the activation) and over [tokens, d_model] per
norm in the backward, fused by XLA; not timed on a GPU.

What stops 10 GiB for all linears (`jaxmem explain configs/lora/llama3-8b-qlora-all-linear-seq512.yaml
model.n_layers=4`, compiled deviceless for rtx4090-24g, scaled to 32 layers): the stacked residuals
mlp_gate, mlp_up and mlp_act ([4, 2, 512, 14336] bf16, 112 MiB per 4 layers each: 0.88 GiB each over 32
layers). mlp_act is the down adapter's input (its dA reads it; q,v does not keep it). Then, 0.25 GiB each
over 32 layers: the attention and MLP norm outputs (the adapters' input), the roped q, the attention context,
and 0.5 GiB of bf16 norm inputs. Recomputing the product in the backward (0.88 GiB) and the norm outputs
from their inputs (0.5 GiB) would still leave about 10.1 GiB (estimated, analytic); not built.
The argument side is the 5.31 GiB base (3.35 GiB of nf4 linears, 1.96 GiB of bf16 embedding and LM head) plus
the adapters' state (all linears: 1.09 GiB with fp32 master and Adam moments; q,v: 0.18 GiB);
`lora.quantize_embeddings: true` with `kernels.loss: chunked` stores the two tables in nf4 too (before the
lean residuals it took q,v from 12.12 to 10.67 GiB, compiled deviceless with jax 0.10.2; not recompiled since)."""

LONG_HEAD = ("Compiled before the change above (commit 2e38dd8: merged weights, only the targeted linears "
             "quantized; all these rows target all seven linears, so their base is the same); not recompiled "
             "since.")


def main(argv: list[str]) -> int:
    from_json, recipes_only = "--from-json" in argv, "--recipes-only" in argv
    saved = OUT / "lora.json"
    record = json.loads(saved.read_text()) if from_json or recipes_only else {}
    recipes = ["| recipe | merged weights: device GiB, compiled deviceless, jax 0.10.2 | "
               "x W + s (x A) B: device GiB, compiled deviceless | "
               "now (lean gated activation and RMSNorm residuals): device GiB, compiled deviceless | "
               "analytic bill GiB, estimated (compiled / analytic) | model FLOPs per step, estimated (cost model) | "
               "goal (GiB) |", "|---|---:|---:|---:|---:|---:|---|"]
    for name, config, before, goal in RECIPES:
        if not from_json:
            print(name, flush=True)
            record.setdefault("recipes", {})[name] = _recipe_record(_plan(config, []))
        recipes.append(_recipe_md(name, before, goal, record["recipes"][name]))
    table = ["| run | longest sequence that fits (probed) | device GiB per GPU, compiled for target | next length | "
             "bill split (estimated, GiB) | goal |", "|---|---:|---:|---|---|---|"]
    for name, config, overrides, seqs, goal in ROWS:
        if not (from_json or recipes_only):
            print(name, flush=True)
            record[name] = {"config": config, "overrides": overrides, "probes": probe(config, overrides, seqs)}
        table.append(_row_md(name, config, overrides, goal, record[name]["probes"]))
    saved.write_text(json.dumps(record, indent=2) + "\n")
    text = ["# LoRA and QLoRA plans", "",
            "Compiled for the named GPU (deviceless) unless labeled estimated. Regenerate: "
            "`JAX_PLATFORMS=cpu .venv/bin/python scripts/lora_plans.py` (about 6 minutes; `--recipes-only`: the "
            "first table).", "", RECIPE_HEAD, "", *recipes, "", RECIPE_NOTES, "",
            "## The longest sequence on one GPU", "", LONG_HEAD, "", *table, "", NOTES, ""]
    (OUT / "lora.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
