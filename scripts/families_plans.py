"""The new model families planned deviceless: writes benchmarks/families/<config>.json (the `jaxmem plan`
JSON, exactly `jaxmem plan CONFIG --json FILE`) and benchmarks/families.md.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/families_plans.py [--from-json] [--no-compile] [config.yaml ...]

--no-compile writes the analytic bill and cost model only (no compiled column).
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
CONFIGS = {
    "configs/qwen3-8b-8xh100.yaml": "Qwen3-8B full fine-tune, FSDP 8 x h100-80g, seq 8192, micro-batch 2, "
                                    "selective remat (the llama3-8b-8xh100 recipe)",
    "configs/gemma3-12b-1xh100.yaml": "Gemma 3 12B (text decoder) full fine-tune, 1 x h100-80g, seq 8192: "
                                      "optimizer state on the host (streamed through the GPU for the "
                                      "update), layer inputs offloaded",
}


# The Gemma 3 recipe at a longer sequence: (config, overrides, JSON name)
LONG_GEMMA = ("configs/gemma3-12b-1xh100.yaml", ["train.seq_len=65536"], "gemma3-12b-1xh100-s65536")


def run_plan(config: str, compile_: bool = True, overrides=(), name: str = "") -> dict:
    from jaxmem.cli import plan as cli

    out = OUT / "families" / f"{name or Path(config).stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cli.main([str(ROOT / config), *overrides, "--json", str(out)] + ([] if compile_ else ["--no-compile"]))
    return json.loads(out.read_text())


def long_gemma_note(plan: dict) -> str:
    config, overrides, name = LONG_GEMMA
    c, cost = plan["compiled"], plan["cost"]
    return (f"- The Gemma 3 12B recipe at seq 65536 (`jaxmem plan {config} {' '.join(overrides)} --json "
            f"benchmarks/families/{name}.json`): {c['device_total'] / GIB:.2f} GiB per GPU compiled for 1 x H100 "
            f"(deviceless; analytic {plan['analytic']['device_total'] / GIB:.2f} GiB, estimated), "
            f"{'fits' if plan['fits'] else 'does not fit'}; cost model {cost['step_seconds']:.1f} s per step, "
            f"MFU {100 * cost['mfu']:.0f}% (estimated).")


def row(config: str, plan: dict) -> str:
    c, a, cost = plan["compiled"], plan["analytic"], plan["cost"]
    compiled = f"**{c['device_total'] / GIB:.2f}**" if c else "not compiled"
    fits = f"{plan['fits']}" + ("" if c else " (analytic)")
    compile_time = f"{c['compile_seconds']:.0f} s" if c else "-"
    return (f"| {CONFIGS.get(config, config)} (`{config}`) | {plan['params'] / 1e9:.2f}B | "
            f"{compiled} | {a['device_total'] / GIB:.2f} | {fits} | "
            f"{plan['host_bytes_per_node'] / GIB:.1f} | {cost['step_seconds']:.2f} s, MFU {100 * cost['mfu']:.0f}% "
            f"| {compile_time} |")


def main(argv: list[str]) -> int:
    from_json, compile_ = "--from-json" in argv, "--no-compile" not in argv
    configs = [a for a in argv if not a.startswith("--")] or list(CONFIGS)
    rows = []
    for config in configs:
        saved = OUT / "families" / f"{Path(config).stem}.json"
        plan = json.loads(saved.read_text()) if from_json else run_plan(config, compile_)
        rows.append(row(config, plan))
        print(f"{config}: fits={plan['fits']}", flush=True)
    config, overrides, name = LONG_GEMMA
    saved = OUT / "families" / f"{name}.json"
    long_plan = json.loads(saved.read_text()) if from_json else run_plan(config, compile_, overrides, name)
    text = ["# Qwen3 and Gemma 3 plans", "",
            "Device totals **compiled for the named GPUs (deviceless)** on a CPU-only machine (jax 0.10.2 + the "
            "CUDA PJRT plugin): XLA's memory analysis of the real train step, per GPU. The analytic column is "
            "the bill (estimated); the step time and MFU are the cost model's (estimated). Nothing here was "
            "measured on a GPU. Plan JSON in `benchmarks/families/`.",
            "Regenerate: `JAX_PLATFORMS=cpu flock /work/wt/heavy.lock .venv/bin/python scripts/families_plans.py`.",
            "", "| run | params | device GiB per GPU (compiled, deviceless) | analytic GiB (estimated) | fits | "
            "host GiB per node | step (estimated) | compile time here |",
            "|---|---:|---:|---:|---|---:|---|---:|", *rows, "",
            "Notes:",
            "- Gemma 3's 40 local layers (window 1024) run the Pallas kernel over the window's band only; the "
            "cost model counts their attention FLOPs by the band (docs/attention.md). Its 262,208-token "
            "vocabulary makes the chunked loss matter: no [T, V] logits.",
            long_gemma_note(long_plan),
            "- Qwen3-8B differs from Llama-3-8B by its q/k norms (recomputed from the saved projections), "
            "36 layers of d_ff 12288 and a 151,936 vocabulary."]
    (OUT / "families.md").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
