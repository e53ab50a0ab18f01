"""The headline configs, planned deviceless: writes benchmarks/headline/<config>.json (the `jaxmem plan`
JSON) and benchmarks/headline.md. Each plan is exactly `jaxmem plan CONFIG --json FILE`.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/headline.py [--from-json]

The notes under the table quote variant plans (VARIANTS, benchmarks/headline/variants/) the same way.
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
HEADLINES = {
    "configs/qwen2-72b-8xh100.yaml": "Qwen2-72B full fine-tune, 8 x h100-80g, seq 32768, micro-batch 1: "
                                     "device total <= 72 GiB per GPU, host within a 2 TB node",
    "configs/qwen2-72b-8xh100-128k.yaml": "Qwen2-72B full fine-tune, 8 x h100-80g, seq 131072, micro-batch 1 "
                                          "(issue #12): sequence parallel sp=8 (Ulysses) + sequence tiling, "
                                          "device total <= 72 GiB per GPU, host within a 2 TB node",
    "configs/qwen2-72b-8xh100-128k-inbackward.yaml": "Qwen2-72B full fine-tune, 8 x h100-80g, seq 131072, "
                                                     "micro-batch 1, the AdamW update inside the backward "
                                                     "(optimizer.update_in_backward), state streamed from host",
    "configs/qwen2-72b-8xh100-512k.yaml": "Qwen2-72B full fine-tune, 8 x h100-80g, seq 524288, micro-batch 1: "
                                          "the update inside the backward, state and layer inputs in host memory",
    "configs/llama3-8b-1xh100-128k.yaml": "Llama-3-8B full fine-tune, 1 x h100-80g, seq 131072",
    "configs/llama3-8b-1x4090.yaml": "Llama-3-8B full fine-tune, 1 x rtx4090-24g, seq 4096",
    "configs/llama3-8b-8xh100.yaml": "Llama-3-8B, FSDP 8 x h100-80g, seq 8192, micro-batch 2, selective remat "
                                     "(torchtitan reports 82.4 GiB for FSDP + selective AC, measured on H100)",
}


# Plans beside the headline ones that the notes quote (benchmarks/headline/variants/<name>.json).
VARIANTS = {
    "qwen2-72b-host-update": ("configs/qwen2-72b-8xh100.yaml", ["offload.optimizer_update=host"]),
    "qwen2-72b-128k-untiled": ("configs/qwen2-72b-8xh100-128k.yaml", ["remat.seq_tile=0"]),
    **{f"qwen2-72b-512k-recipe-at-{seq}": ("configs/qwen2-72b-8xh100-512k.yaml",
                                            [f"train.seq_len={seq}", f"model.max_seq_len={max(seq, 524288)}"])
       for seq in (131072, 262144, 786432)},
}


def _remat_trim(plan: dict) -> str:
    """XLA's rematerialization pass's own before -> after (GiB), from its warning in the plan."""
    import re

    for w in plan["warnings"]:
        m = re.search(r"only reduced to ([\d.]+)GiB.*down from ([\d.]+)GiB", w)
        if m:
            return f"{m.group(2)} -> {m.group(1)} GiB"
    return "no trim reported"


def notes(plans: dict, variants: dict) -> str:
    """The notes under the table; every figure read from a plan here (compiled deviceless or estimated)."""
    dev = lambda p: p["compiled"]["device_total"] / GIB  # noqa: E731
    host = lambda p: p["compiled"]["host_total"] / GIB  # noqa: E731
    node = lambda p: p["host_bytes_per_node"] / GIB  # noqa: E731
    q32, q128 = plans["configs/qwen2-72b-8xh100.yaml"], plans["configs/qwen2-72b-8xh100-128k.yaml"]
    q128b, q512 = plans["configs/qwen2-72b-8xh100-128k-inbackward.yaml"], plans["configs/qwen2-72b-8xh100-512k.yaml"]
    l8 = plans["configs/llama3-8b-8xh100.yaml"]
    hu, untiled = variants["qwen2-72b-host-update"], variants["qwen2-72b-128k-untiled"]
    at = {seq: variants[f"qwen2-72b-512k-recipe-at-{seq}"] for seq in (131072, 262144, 786432)}
    state = q32["params"] * 12 / 8 / GIB  # fp32 master + Adam m, v, sharded 8 ways
    inputs = lambda seq: 80 * seq * 8192 * 2 / GIB  # noqa: E731  (80 layers' bf16 inputs, d_model 8192)
    step = lambda p: p["cost"]["step_seconds"]  # noqa: E731
    serial, no_sp_node = q32["cost"]["serial_host_seconds"], (state + inputs(131072)) * 8
    return f"""Notes (every GiB figure compiled for 8 x h100-80g (deviceless) unless marked estimated):
- Qwen2-72B fits at the full sequence 32768 (no fallback to a shorter sequence was needed). Its host side
  holds the fp32 master + Adam m, v (12 bytes per parameter, sharded 8 ways: {state:.1f} GiB per GPU) and the
  offloaded layer inputs ({inputs(32768):.0f} GiB per GPU) once: {node(q32) / 1024:.2f} TiB per node. The AdamW
  update streams each layer's state through the GPU (`offload.optimizer_update=device`); with the update
  run on the host instead (`=host`), XLA's host computation writes its results into a host temp pool (a
  second copy of the state) and the node needs {node(hu) / 1024:.2f} TiB ({host(hu):.1f} GiB per GPU). The price of
  streaming: the device total is {dev(q32):.2f} GiB against {dev(hu):.2f} with the host update, and the cost model
  adds {serial:.1f} s of serial PCIe traffic to a {step(q32):.1f} s step (estimated; the host update's own CPU time is
  priced as measured on one H200's host: benchmarks/costmodel.md).
- Qwen2-72B at seq 131072 (issue #12) fits with sequence parallelism instead of FSDP: `parallel.sp=8`
  (Ulysses; attention runs on whole sequences with 64 / 8 = 8 query heads and 1 kv head per GPU, so the
  Pallas kernel takes it) shards weights, gradients and optimizer state over the same 8 GPUs and leaves
  131072 / 8 = 16384 tokens per GPU outside attention, half the 32768 of the FSDP config. Host side: the
  fp32 master + Adam m, v ({state:.1f} GiB per GPU) and the offloaded layer inputs (80 x 16384 x 8192 bf16 =
  {inputs(16384):.0f} GiB per GPU) once, {node(q128):.1f} GiB per node. Without sequence parallelism (fsdp=8, 131072
  tokens per GPU) the offloaded layer inputs alone would be {inputs(131072):.0f} GiB per GPU and the host side
  ~{no_sp_node:,.0f} GiB per node, over the 2,048 GiB node (estimated: 12 B/param / 8 + 80 x 131072 x 8192
  x 2 B). `remat.seq_tile=4096` trims the device total from {dev(untiled):.2f} GiB (`remat.seq_tile=0`) to
  {dev(q128):.2f} GiB; the cost model gives {step(untiled):.1f} s and {step(q128):.1f} s per step (estimated).
- The same 131072-token run with the AdamW update inside the backward (`optimizer.update_in_backward`,
  `configs/qwen2-72b-8xh100-128k-inbackward.yaml`): {dev(q128b):.2f} GiB per GPU and {node(q128b):.1f} GiB of host per
  node: the host holds the fp32 master + Adam m, v once and nothing else, because the layer inputs stay on
  the GPU (the backward rebuilds each layer from its input), and no whole-model gradient exists. The price:
  clipping by the previous step's global norm.
- Qwen2-72B at seq 524288 (`configs/qwen2-72b-8xh100-512k.yaml`): the in-backward run with the layer inputs
  in pinned host memory too (`remat.preset=offload_layer_inputs`; the backward fetches each layer's input
  when it rebuilds that layer): {dev(q512):.2f} GiB per GPU and {node(q512):.1f} GiB of host per node. The host holds
  the state and the layer inputs (80 x 65536 x 8192 bf16 = {inputs(65536):.0f} GiB per GPU). The same recipe at
  131072 tokens compiles to {dev(at[131072]):.2f} GiB per GPU ({node(at[131072]):.1f} GiB host per node), at
  262144 to {dev(at[262144]):.2f}, at 786432 to {dev(at[786432]):.2f} ({node(at[786432]):.1f} GiB host per node).
  For scale: ALST reports Llama-3-70B at 200K tokens on 8 x H100 (measured there; compiled here, not the same kind of
  figure). The cost model estimates {step(q512):.0f} s per 524288-token step (MFU {q512["cost"]["mfu"]:.0%}, estimated);
  the host link carries the state and the layer inputs each step.
- Llama-3-8B on 8 x h100-80g (FSDP, seq 8192, micro-batch 2, selective remat, no offload): compare with
  the 82.4 GiB torchtitan reports for FSDP + selective activation checkpointing on H100 (measured on GPU
  there, compiled deviceless here: not the same kind of figure). XLA's rematerialization pass trimmed
  {_remat_trim(l8)} by its own count to approach its budget (see that section).
- The RTX 4090 recipe streams the optimizer state through the GPU a layer at a time instead of running
  AdamW on the host: the host-side update needs a second copy of the state in host memory (~210 GiB in
  all, estimated), which a 128 GiB workstation (the target's assumed host RAM) does not have.
- XLA's `hlo_rematerialization` warnings quote totals that include pinned-host bytes; where it says
  "down from X originally" with the same X, it changed nothing."""


def run_plan(config: str, out: Path, overrides: tuple = ()) -> dict:
    from jaxmem.cli import plan as cli

    out.parent.mkdir(parents=True, exist_ok=True)
    cli.main([str(ROOT / config), *overrides, "--json", str(out)])
    return json.loads(out.read_text())


def _levers(cfg) -> str:
    p, o, r, k = cfg.precision, cfg.offload, cfg.remat, cfg.kernels
    return (f"params {p.param_dtype} (master fp32: {p.master_weights}), grads reduced in {p.grad_reduce_dtype}, "
            f"remat `{r.preset}`, optimizer state on {o.optimizer} (update on "
            f"{o.optimizer_update if o.optimizer == 'host' else 'device'}), params on {o.params}, "
            f"attention `{k.attention}`, loss `{k.loss}`")


def section(config: str, plan: dict) -> str:
    from jaxmem.loader import load_config

    cfg = load_config(ROOT / config)
    c = plan["compiled"]
    label = c["label"]
    lines = [f"## {HEADLINES.get(config, config)}", "",
             f"Command: `JAX_PLATFORMS=cpu jaxmem plan {config} --json benchmarks/headline/{Path(config).stem}.json`",
             f"Levers: {_levers(cfg)}.", "",
             "| figure | value |", "|---|---:|",
             f"| device total per GPU ({label}) | **{c['device_total'] / GIB:.2f} GiB** |",
             f"| of which arguments (params, {'' if cfg.offload.optimizer == 'host' else 'optimizer, '}...) "
             f"| {(c['argument']) / GIB:.2f} GiB |",
             f"| of which temporaries (grads, activations, workspace) | {c['temp'] / GIB:.2f} GiB |",
             *([f"| init: building the step-0 state from {c['init']['source']} ({label}) "
                f"| {c['init']['device_total'] / GIB:.2f} GiB |"] if c.get("init") else []),
             f"| usable per GPU (capacity x (1 - headroom {plan['target']['headroom']})) "
             f"| {plan['usable_device_bytes'] / GIB:.2f} GiB |",
             f"| fits | {plan['fits']} |",
             f"| host bytes per GPU ({label}) | {c['host_total'] / GIB:.2f} GiB |",
             f"| host bytes per node (x {plan['target']['gpus_per_host']} GPUs) "
             f"| {plan['host_bytes_per_node'] / GIB:.1f} GiB of {plan['target']['host_ram_bytes'] / GIB:.0f} GiB |",
             f"| offload | {plan['offload']['message']} |",
             f"| compile time on this CPU machine | {c['compile_seconds']:.0f} s |"]
    if plan["warnings"]:
        lines += ["", "XLA warnings during the compile (its rematerialization pass counts host bytes too):", ""]
        lines += [f"- `{w}`" for w in plan["warnings"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from_json = "--from-json" in argv  # re-render the markdown from the saved plans, no compiles
    unknown = [a for a in argv if a != "--from-json"]
    if unknown:
        raise SystemExit(f"headline.py: takes only --from-json (got {unknown}); the notes read every config's plan")
    sections, summary = [], ["| config | device GiB per GPU | fits | host GiB per node |", "|---|---:|---|---:|"]
    plans, variants = {}, {}
    for name, (config, overrides) in VARIANTS.items():
        saved = OUT / "headline" / "variants" / f"{name}.json"
        variants[name] = json.loads(saved.read_text()) if from_json else run_plan(config, saved, tuple(overrides))
    for config in HEADLINES:
        saved = OUT / "headline" / f"{Path(config).stem}.json"
        plan = plans[config] = json.loads(saved.read_text()) if from_json else run_plan(config, saved)
        sections.append(section(config, plan))
        summary.append(f"| `{config}` | {plan['compiled']['device_total'] / GIB:.2f} | {plan['fits']} | "
                       f"{plan['host_bytes_per_node'] / GIB:.1f} |")
        print(f"{config}: {plan['compiled']['device_total'] / GIB:.2f} GiB per device, fits={plan['fits']}",
              flush=True)
    head = ["# Headline configs: do they fit?", "",
            "Every figure below is **compiled for the named GPUs (deviceless)** on a CPU-only machine with "
            "jax 0.10.2 and the CUDA PJRT plugin: XLA's memory analysis of the real train step "
            "(device = argument + output - alias + temp, per GPU; host = pinned host memory). Nothing here "
            "was measured on a GPU. The plan JSON of each config is in `benchmarks/headline/`.",
            "Regenerate: `JAX_PLATFORMS=cpu .venv/bin/python scripts/headline.py` (about 5 minutes).", "",
            *summary, "", notes(plans, variants), ""]
    (OUT / "headline.md").write_text("\n".join(head) + "\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
