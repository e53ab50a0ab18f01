"""Long-context plans, compiled deviceless: Llama-3-8B full fine-tunes from 262,144 tokens on one H100 to
4,194,304 (and past) on eight. Writes benchmarks/long_context.json and benchmarks/long_context.md.

Each row is `jaxmem plan CONFIG [overrides]`; a row that does not fit is explained (`jaxmem explain`): the
largest device buffers at the compiled peak say what stops it.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/long_context.py [--from-json]  (--from-json: compile new rows only)
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
CFG = "configs/long-context/llama3-8b-{}.yaml"

# (row name, config, overrides, what the row shows)
ROWS = [
    ("1 GPU, 256K", CFG.format("1xh100-256k"), [], "issue #9 length"),
    ("1 GPU, 512K", CFG.format("1xh100-512k"), [], "issue #9 goal (ALST: 500K on one H100)"),
    ("1 GPU, 512K, no tiling", CFG.format("1xh100-512k"), ["remat.seq_tile=0"], "what sequence tiling buys"),
    ("1 GPU, 1M", CFG.format("1xh100-512k"), ["train.seq_len=1048576", "model.max_seq_len=1048576"],
     "past the goal"),
    ("1 GPU, 1M, update in backward", CFG.format("1xh100-512k"),
     ["train.seq_len=1048576", "model.max_seq_len=1048576", "optimizer.update_in_backward=true",
      "offload.optimizer_update=device", "remat.seq_tile=8192"],
     "the 1M row with the AdamW update inside the backward (no whole-model gradient, state streamed per layer)"),
    ("8 GPUs, 1M", CFG.format("8xh100-1m"), [], "issue #9 length"),
    ("8 GPUs, 4M", CFG.format("8xh100-4m"), [], "issue #9 goal (ALST: 3.7M on 8 x H100)"),
    ("8 GPUs, 4M, sp=8 without tiling", CFG.format("8xh100-4m"), ["remat.seq_tile=0"], "what sequence tiling buys"),
    ("8 GPUs, 8M", CFG.format("8xh100-4m"), ["train.seq_len=8388608", "model.max_seq_len=8388608"],
     "past the goal"),
]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def run_row(name: str, config: str, overrides: list[str]) -> dict:
    from jaxmem.cli import plan as cli

    out = OUT / "long_context" / f"{_slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cli.main([str(ROOT / config), *overrides, "--json", str(out)])
    plan = json.loads(out.read_text())
    if not plan["fits"]:
        plan["stopped_by"] = _largest_device_buffers(config, overrides)
        out.write_text(json.dumps(plan, indent=2))
    return plan


def _largest_device_buffers(config: str, overrides: list[str], top: int = 4) -> list[dict]:
    """The biggest device buffers live at the compiled peak (host-memory buffers left out)."""
    from jaxmem.runtime.aot import resolve_topology
    from jaxmem.loader import load_config
    from jaxmem.plan.explain import explain

    cfg = load_config(ROOT / config, overrides)
    result = explain(cfg, resolve_topology(cfg), top=40)
    device = [b for b in result["buffers"] if "(host memory)" not in b["why"]]
    return [{k: b[k] for k in ("bytes", "shape", "dtype", "category", "source", "why")} for b in device[:top]]


def _row_md(name: str, config: str, overrides: list[str], note: str, plan: dict) -> str:
    c, cost = plan["compiled"], plan["cost"]
    mesh = plan["mesh"]
    cfg_ref = f"`{config}`" + (f" `{' '.join(overrides)}`" if overrides else "")
    seq = next((o.split("=")[1] for o in overrides if o.startswith("train.seq_len=")), None)
    return (f"| {name} | {cfg_ref} | {int(seq) if seq else _seq_of(config):,} | sp={mesh.get('sp', 1)} | "
            f"**{c['device_total'] / GIB:.2f}** | {_fits_md(plan)} | "
            f"{plan['host_bytes_per_node'] / GIB:,.0f} of {plan['target']['host_ram_bytes'] / GIB:,.0f} | "
            f"{cost['step_seconds']:,.0f} | {note} |")


def _fits_md(plan: dict) -> str:
    if not plan["fits"]:
        return "**no**"
    return "**no** (host RAM)" if plan.get("host_fits") is False else "yes"


def _seq_of(config: str) -> int:
    from jaxmem.loader import load_config

    return load_config(ROOT / config).train.seq_len


def _stopped_md(name: str, plan: dict) -> list[str]:
    lines = [f"**{name}** does not fit: {plan['compiled']['device_total'] / GIB:.2f} GiB compiled against "
             f"{plan['usable_device_bytes'] / GIB:.2f} GiB usable. The largest device buffers at the peak "
             "(`jaxmem explain`, compiled for target):", ""]
    for b in plan.get("stopped_by", []):
        lines.append(f"- {b['bytes'] / GIB:.2f} GiB `{b['dtype']}{b['shape']}` ({b['category']}): {b['source']}; "
                     f"{b['why']}")
    return lines + [""]


NOTES = """How to read it:
- **device GiB**: XLA's memory analysis of the real train step compiled for the target (argument + output -
  alias + temp per GPU), deviceless on this CPU-only machine. **host GiB per node**: the pinned host bytes
  of the same compile times the GPUs per node, against the target's host RAM. **step s**: estimated by the
  calibrated cost model (benchmarks/costmodel.md); at these lengths attention's T^2 term is almost all of it.
  Nothing here was measured on a GPU.
- What each lever does, from the rows: sequence tiling (`remat.seq_tile=16384`) keeps the per-token parts
  of a layer (norms, q/k/v/o projections, RoPE, the SwiGLU MLP) to one tile at a time, so the layer's
  [T, d_ff] intermediates never exist whole; offloading the layer inputs puts the 32 per-layer
  [T, 4096] bf16 checkpoints in pinned host memory; sequence parallelism (`parallel.sp=8`) splits every
  activation along the sequence and, inside attention, the heads (Ulysses all-to-alls), and shards the
  weights, gradients and optimizer state over the same 8 GPUs.
- **1 GPU, 1M, update in backward**: `optimizer.update_in_backward` (each layer's AdamW update runs in the
  backward as soon as its gradient exists, the fp32 master, m and v streamed from pinned host memory a layer
  at a time; clipping by the previous step's norm) removes the whole-model gradient and the update phase, and
  brings the 1M row under the H100's usable memory. One step is over an hour (estimated).
- Compare with ALST (Arctic Long Sequence Training, arXiv 2506.13996; measured on H100s there, compiled
  deviceless here: not the same kind of figure): Llama-8B at 500K tokens on one H100, 3.7M on 8 x H100.
- Step times at these lengths are long (attention is quadratic); the first step of a 4M run is hours. The
  plans say nothing about convergence at these lengths (RoPE scaling is the model's own: Llama-3 rope
  settings from the preset, max_seq_len raised)."""


def main(argv: list[str]) -> int:
    from_json = "--from-json" in argv
    table = ["| run | config | sequence | mesh | device GiB per GPU (compiled for target) | fits | "
             "host GiB per node | step s (estimated) | shows |", "|---|---|---:|---|---:|---|---:|---:|---|"]
    stopped, record = [], {}
    for name, config, overrides, note in ROWS:
        saved = OUT / "long_context" / f"{_slug(name)}.json"
        # --from-json: rows whose plan is saved are re-rendered; a new row is compiled
        plan = json.loads(saved.read_text()) if from_json and saved.exists() else run_row(name, config, overrides)
        record[name] = {"config": config, "overrides": overrides, "device_total": plan["compiled"]["device_total"],
                        "fits": plan["fits"], "host_bytes_per_node": plan["host_bytes_per_node"],
                        "step_seconds": plan["cost"]["step_seconds"], "label": plan["compiled"]["label"],
                        "stopped_by": plan.get("stopped_by", [])}
        table.append(_row_md(name, config, overrides, note, plan))
        if not plan["fits"]:
            stopped += _stopped_md(name, plan)
        print(f"{name}: {plan['compiled']['device_total'] / GIB:.2f} GiB, fits={plan['fits']}", flush=True)
    (OUT / "long_context.json").write_text(json.dumps(record, indent=2) + "\n")
    text = ["# Long context: Llama-3-8B full fine-tunes at 256K-8M tokens", "",
            "Every figure is **compiled for the named GPUs (deviceless)** or **estimated** as labeled; the plan "
            "JSON of each row is in `benchmarks/long_context/`. Regenerate: "
            "`JAX_PLATFORMS=cpu .venv/bin/python scripts/long_context.py` (about 5 minutes).", "",
            *table, "", *stopped, NOTES, ""]
    (OUT / "long_context.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
