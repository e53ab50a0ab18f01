"""The mixture-of-experts plans, deviceless: writes benchmarks/moe.json and benchmarks/moe.md.

    JAX_PLATFORMS=cpu .venv/bin/python scripts/moe_plans.py [--only NAME ...] [--ep N] [--from-json]

Each row is compiled once for its target with dumps (`jaxmem explain`): XLA's device total and the largest
buffers live at the peak; the analytic bill and the cost model come from the same config without a compile.
A row with `search` finds the longest power-of-two sequence that fits: the bill proposes the first length to
compile, then compiles go up while they fit and down while they do not. --only runs the named rows and
merges them into moe.json (48-layer compiles take minutes and a few GiB: one row at a time); --ep N plans
every full fine-tune with parallel.ep=N into moe-epN.json (expert parallelism); moe.md shows
each row with its ep twin. --from-json recomputes the bill and cost model from this tree, keeps the compiled
figures, and rewrites the table.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks"
GIB = 1024**3
HOW_COMPILED = "compiled deviceless (h100-80g, jax {jax})"
ROWS = [
    {"name": "qwen3-30b-a3b-fsdp8-seq8192", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml", "overrides": [],
     "what": "Qwen3-30B-A3B full fine-tune, FSDP 8 x H100, seq 8192, micro-batch 1, full remat"},
    {"name": "qwen3-30b-a3b-fsdp8-longest", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml",
     "overrides": ["offload.optimizer=host", "offload.optimizer_update=device"], "search": True,
     "what": "Qwen3-30B-A3B full fine-tune, FSDP 8 x H100, the longest sequence that fits: full remat, "
             "optimizer state on the host (update streamed through the GPU), micro-batch 1"},
    {"name": "mixtral-8x7b-fsdp8-seq8192", "config": "configs/moe/mixtral-8x7b-8xh100.yaml", "overrides": [],
     "what": "Mixtral-8x7B full fine-tune, FSDP 8 x H100, seq 8192, micro-batch 1, full remat"},
    {"name": "mixtral-8x7b-fsdp8-longest", "config": "configs/moe/mixtral-8x7b-8xh100.yaml",
     "overrides": ["offload.optimizer=host", "offload.optimizer_update=device"], "search": True,
     "what": "Mixtral-8x7B full fine-tune, 8 x H100, the longest sequence that fits: full remat, optimizer "
             "state on the host (update streamed through the GPU), micro-batch 1"},
    {"name": "qwen3-30b-a3b-ep8-cap1.25-seq8192", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml",
     "overrides": ["parallel.ep=8", "model.moe_capacity_factor=1.25"],
     "what": "Qwen3-30B-A3B full fine-tune, ep 8 x H100 with capacity factor 1.25 (drops past it), seq 8192, "
             "micro-batch 1, full remat"},
    {"name": "qwen3-30b-a3b-ep8-cap1.25-longest", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml",
     "overrides": ["parallel.ep=8", "model.moe_capacity_factor=1.25",
                   "offload.optimizer=host", "offload.optimizer_update=device"], "search": True,
     "what": "Qwen3-30B-A3B full fine-tune, ep 8 x H100 with capacity factor 1.25, the longest sequence that fits: "
             "full remat, optimizer state on the host, micro-batch 1"},
    # no config file of its own until LoRA on experts exists (every file under configs/ must load)
    {"name": "qwen3-30b-a3b-qlora-1xh100-longest", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml",
     "overrides": ["parallel.fsdp=1", "target.gpus_per_host=1", "remat.preset=offload_layer_inputs", "lora.rank=16",
                   "lora.alpha=32", "lora.targets=all-linear", "lora.base_dtype=nf4", "lora.double_quant=true"],
     "search": True, "lora": True,
     "what": "Qwen3-30B-A3B QLoRA (nf4 base, rank 16 on every linear, experts included), 1 x H100, the longest "
             "sequence that fits, layer inputs offloaded"},
    {"name": "qwen3-30b-a3b-qlora-1xh100-tiled-longest", "config": "configs/moe/qwen3-30b-a3b-8xh100.yaml",
     "overrides": ["parallel.fsdp=1", "target.gpus_per_host=1", "remat.preset=offload_layer_inputs", "lora.rank=16",
                   "lora.alpha=32", "lora.targets=all-linear", "lora.base_dtype=nf4", "lora.double_quant=true",
                   "remat.seq_tile=16384"],
     "search": True, "lora": True,
     "what": "the same, with the MLP and experts in 16384-token sequence tiles (remat.seq_tile)"},
    {"name": "gpt-oss-20b-qlora-1xh100-untiled-longest", "config": "configs/moe/gpt-oss-20b-qlora-1xh100.yaml",
     "overrides": ["remat.seq_tile=0"], "search": True, "lora": True,
     "what": "gpt-oss-20b QLoRA (nf4 base, rank 16 on every linear, experts included), 1 x H100, the longest "
             "sequence that fits, layer inputs offloaded, no sequence tiles"},
    {"name": "gpt-oss-20b-qlora-1xh100-longest", "config": "configs/moe/gpt-oss-20b-qlora-1xh100.yaml",
     "overrides": [], "search": True, "lora": True,
     "what": "the same with the MLP and experts in 16384-token sequence tiles (the config's remat.seq_tile)"},
]
# Reduced models (2 layers; the layer scan compiles once, so the routed-row buffers are the full models'):
# the bill against the compiled total where a compile takes a minute or two.
_BF16 = ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true"]
CHECKS = [
    {"name": "check-tiny-moe", "config": "configs/tiny-moe.yaml", "check": True,
     "overrides": ["target.name=h100-80g", "target.gpus_per_host=8", "remat.preset=full", *_BF16],
     "what": "tiny-moe (8 experts, top 2), bf16, full remat, 8 x H100, seq 64, micro-batch 2"},
    *[{"name": f"check-{m}-2l-seq{s}", "config": f"configs/moe/{m}-8xh100.yaml", "check": True,
       "overrides": ["model.n_layers=2", f"train.seq_len={s}"],
       "what": f"{m} widths, 2 layers, seq {s}, FSDP 8 x H100, full remat"}
      for m, s in (("qwen3-30b-a3b", 256), ("qwen3-30b-a3b", 1024), ("mixtral-8x7b", 1024), ("mixtral-8x7b", 8192))],
    # Expert parallelism, with the default kernel and with ragged_dot (its dense copies' live set is fitted)
    *[{"name": f"check-{name}-ep8{'-cap' + str(c) if c else ''}{'-ragged' if kernel else ''}", "config": config,
       "check": True,
       "overrides": [*over, "parallel.ep=8", "parallel.fsdp=1", f"model.moe_capacity_factor={c}",
                     *([f"kernels.grouped_matmul={kernel}"] if kernel else [])],
       "what": f"{what}, ep 8 ({'capacity factor %s' % c if c else 'dropless'})"}
      for name, config, over, what in (
          ("tiny-moe", "configs/tiny-moe.yaml", ["target.name=h100-80g", "target.gpus_per_host=8",
                                                 "remat.preset=full", *_BF16], "tiny-moe, bf16, full remat, 8 x H100"),
          ("qwen3-30b-a3b-2l-seq1024", "configs/moe/qwen3-30b-a3b-8xh100.yaml",
           ["model.n_layers=2", "train.seq_len=1024"], "qwen3-30b-a3b widths, 2 layers, seq 1024, 8 x H100"),
          ("mixtral-8x7b-2l-seq1024", "configs/moe/mixtral-8x7b-8xh100.yaml",
           ["model.n_layers=2", "train.seq_len=1024"], "mixtral-8x7b widths, 2 layers, seq 1024, 8 x H100"))
      for c in (0, 1.25) for kernel in ("", "ragged_dot") if not (kernel and name == "tiny-moe")],
]
SEQ_RANGE = [2**k for k in range(6, 21)]  # 64 ... 1048576




def _load(row: dict, seq: int | None, ep: int):
    from jaxmem.loader import load_config

    over = list(row["overrides"]) + ([f"train.seq_len={seq}", f"model.max_seq_len={max(seq, 4096)}"] if seq else [])
    if ep > 1 and not row.get("lora"):
        over.append(f"parallel.ep={ep}")
    return load_config(str(ROOT / row["config"]), over), over


def _sets_ep(row: dict) -> bool:
    """A row whose own overrides choose expert parallelism (it has no --ep twin)."""
    return any(o.startswith("parallel.ep=") for o in row["overrides"])


def _kernel(cfg, n_devices: int) -> str:
    from jaxmem import kernels

    return kernels.resolve(cfg.kernels, "gpu", n_devices)["grouped_matmul"]


def analytic(row: dict, seq: int | None, ep: int) -> dict:
    """The plan without a compile: the bill, the cost model, the usable bytes."""
    from jaxmem.plan import plan, resolve_topology

    cfg, over = _load(row, seq, ep)
    p = plan(cfg, resolve_topology(cfg), compile=False, source=row["config"])
    from jaxmem.mesh.sharding import mesh_shape

    n_devices = cfg.target.gpus_per_host * cfg.target.hosts
    sizes = mesh_shape(cfg.parallel, n_devices)
    return {"overrides": over, "kernel": _kernel(cfg, n_devices), "mesh_ep": cfg.parallel.ep,
            "mesh": {a: n for a, n in sizes.items() if n > 1},
            "capacity_factor": cfg.model.moe_capacity_factor, "seq_len": cfg.train.seq_len, "params": p["params"],
            "active_params": p["active_params"], "analytic_bytes": p["analytic"]["device_total"],
            "usable_bytes": p["usable_device_bytes"], "step_seconds_estimated": p["cost"]["step_seconds"],
            "mfu_estimated": p["cost"]["mfu"], "notes": p["analytic"]["notes"]}


def compiled(row: dict, seq: int | None, ep: int) -> dict:
    """One deviceless compile with dumps, in a child process (a 48-layer HLO holds a few GiB until it exits)."""
    start = time.time()
    done = subprocess.run([sys.executable, __file__, "--child", row["name"], str(seq or 0), str(ep)],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    if line is None:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return dict(json.loads(line[len("RESULT"):]), wall_seconds=round(time.time() - start))


def child_run(name: str, seq: int | None, ep: int) -> dict:
    """In the child: explain's compile (device total and the top buffer at the peak)."""
    import jax

    from jaxmem.plan import resolve_topology
    from jaxmem.plan.explain import explain

    row = next(r for r in ROWS + CHECKS if r["name"] == name)
    cfg, _ = _load(row, seq, ep)
    result = explain(cfg, resolve_topology(cfg), top=12)
    keys = ("bytes", "shape", "dtype", "category", "checkpoint_name", "source", "why")
    peak = [{k: b.get(k) for k in keys} for b in result["buffers"]]
    return {"compiled_bytes": result["compiled_device_bytes"], "compiled_how": HOW_COMPILED.format(jax=jax.__version__),
            "limiting_buffer": peak[0] if peak else {k: None for k in keys}, "peak_buffers": peak}


def plan_row(row: dict, ep: int) -> dict:
    """The row's figures; a search row at the longest power-of-two sequence whose compiled total fits."""
    from jaxmem.config.schema import ConfigError

    if not row.get("search"):
        try:
            base = analytic(row, None, ep)
        except ConfigError as e:  # e.g. a lever not supported with expert parallelism
            return {"name": row["name"], "what": row["what"], "refused": str(e), "ep": ep}
        return {"name": row["name"], "what": row["what"], "ep": ep, **base, **compiled(row, None, ep)}
    bills, refused = {}, None
    for s in SEQ_RANGE:
        try:
            bills[s] = analytic(row, s, ep)
        except ConfigError as e:  # e.g. a sequence that remat.seq_tile does not divide
            refused = refused or str(e)
    if not bills:
        return {"name": row["name"], "what": row["what"], "refused": refused, "ep": ep}
    fitting = [s for s in bills if bills[s]["analytic_bytes"] <= bills[s]["usable_bytes"]]
    seq = fitting[-1] if fitting else min(bills)
    tried: dict[int, dict] = {}
    while seq in bills and seq not in tried:
        tried[seq] = compiled(row, seq, ep)
        fits = tried[seq].get("compiled_bytes", float("inf")) <= bills[seq]["usable_bytes"]
        seq = seq * 2 if fits else seq // 2
    fit = [s for s, c in tried.items() if c.get("compiled_bytes", float("inf")) <= bills[s]["usable_bytes"]]
    best = max(fit) if fit else min(tried)
    return {"name": row["name"], "what": row["what"], "ep": ep, **bills[best], **tried[best],
            "fits_at_longest": bool(fit),
            "search": {str(s): {"compiled_bytes": c.get("compiled_bytes"), "analytic_bytes": bills[s]["analytic_bytes"],
                                "error": c.get("error")} for s, c in sorted(tried.items())}}


def _gib(x) -> str:
    return f"{x / GIB:.2f}" if isinstance(x, (int, float)) else "-"


def _size(x) -> str:
    """A buffer's size: GiB, or MiB below a hundredth of a GiB (tiny-moe's buffers)."""
    return f"{x / GIB:.2f} GiB" if x >= GIB / 100 else f"{x / 2**20:.2f} MiB"


def _mesh(r: dict) -> str:
    mesh, cap = r.get("mesh", {}), r.get("capacity_factor") or 0
    out = " x ".join(f"{a} {n}" for a, n in mesh.items()) or "1 GPU"
    return out + (f" ({'capacity %s' % cap if cap else 'dropless'})" if "ep" in mesh else "")


def _top(r: dict) -> str:
    top = r["limiting_buffer"]
    return f"{_size(top['bytes'])} {top['dtype']} {top['shape']} ({top['category']}, {top['source']})"


def render(rows: list[dict]) -> str:
    lines = ["# Mixture-of-experts plans", "",
             "Device totals **compiled deviceless (h100-80g, jax 0.10.2)** on a CPU-only machine: XLA's memory "
             "analysis of the real train step, per GPU. The analytic column is the bill (**estimated**), the "
             "step time the cost model's (**estimated**, active-expert FLOPs). Nothing here ran on a GPU. "
             "Regenerate: `JAX_PLATFORMS=cpu .venv/bin/python scripts/moe_plans.py` (`--ep 8` for the "
             "expert-parallel rows, `--only NAME` for one row, `--from-json` to recompute the bill only).", "",
             "| run | mesh | grouped matmul | params (active) | seq | device GiB (compiled deviceless) | analytic GiB "
             "(estimated) | analytic / compiled | usable GiB | fits | limiting buffer at the peak (explain) "
             "| step (estimated) |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    checks = [r for r in rows if r["name"].startswith("check-")]
    for r in [r for r in rows if not r["name"].startswith("check-")]:
        if "refused" in r:
            pending = "pending LoRA on experts" if r["refused"].startswith("lora.") else "refused"
            lines.append(f"| {r['what']} | - | - | - | - | {pending} | - | - | - | - | "
                         f"refused: {r['refused']} | - |")
            continue
        if "error" in r:
            lines.append(f"| {r['what']} | {_mesh(r)} | {r.get('kernel', '-')} | - | {r.get('seq_len', '-')} | "
                         f"compile failed: {r['error']} | {_gib(r.get('analytic_bytes'))} | - | - | - | - | - |")
            continue
        fits = r["compiled_bytes"] <= r["usable_bytes"]
        over = "yes" if fits else f"no, by {_gib(r['compiled_bytes'] - r['usable_bytes'])} GiB"
        lines.append(f"| {r['what']} | {_mesh(r)} | {r.get('kernel', '-')} | {r['params'] / 1e9:.2f}B "
                     f"({r['active_params'] / 1e9:.2f}B) | {r['seq_len']} | **{_gib(r['compiled_bytes'])}** | "
                     f"{_gib(r['analytic_bytes'])} | {r['analytic_bytes'] / r['compiled_bytes']:.2f} | "
                     f"{_gib(r['usable_bytes'])} | {over} | {_top(r)} | {r['step_seconds_estimated']:.2f} s |")
        if "search" in r:
            tried = ", ".join(f"seq {s}: {_gib(v['compiled_bytes'])} compiled / {_gib(v['analytic_bytes'])} "
                              f"analytic GiB" for s, v in r["search"].items())
            lines.append(f"|  | | | search (powers of 2) | | {tried} | | | | | | |")
    lines += ["", "Peers, measured on their GPUs (their own published figures): Unsloth trains gpt-oss-20b QLoRA on "
              "one 80 GB H100 at 290K tokens with its chunked cross-entropy alone and at 500K+ with its tiled MLP. "
              "Class: both 4-bit QLoRA with activation checkpoints in host memory (ours: each layer's input) and a "
              "chunked loss, tiled MLP against our `remat.seq_tile`; Unsloth's rank and targets are not in our "
              "notes (ours: rank 16 on every linear, experts included). Ours are compiled deviceless, not "
              "measured: 131072 tokens untiled, 1048576 with 16384-token tiles (where the search's range ends), "
              "planned with jax 0.10.2, whose host-offload schedule came out 5 GiB leaner than jax 0.11.2's on the "
              "dense 1-GPU 128K recipe: the 2.4 GiB of room at 1M may not hold on jax 0.11+."]
    if checks:
        lines += ["", "The bill against the compiled total on reduced models (2 layers: the layer scan compiles "
                  "one layer, so each layer's buffers are the full model's):", "",
                  "| check | grouped matmul | device GiB (compiled deviceless) | analytic GiB (estimated) | "
                  "analytic / compiled | limiting buffer |", "|---|---|---:|---:|---:|---|"]
        for r in checks:
            if "compiled_bytes" not in r:
                lines.append(f"| {r['what']} | {r.get('kernel', '-')} | "
                             f"{r.get('refused') or 'failed: ' + r.get('error', '-')} | | | |")
                continue
            top = r["limiting_buffer"]
            lines.append(f"| {r['what']} | {r.get('kernel', '-')} | {_gib(r['compiled_bytes'])} | "
                         f"{_gib(r['analytic_bytes'])} | {r['analytic_bytes'] / r['compiled_bytes']:.2f} | "
                         f"{_size(top['bytes'])} {top['dtype']} {top['shape']} |")
    lines += ["", "How the bill counts the experts (`jaxmem/moe/bill.py`, per `kernels.grouped_matmul` as "
              "`jaxmem.kernels.resolve` picks it):", "",
              "- **blocked** (the default): each expert's rows padded to blocks of "
              "`kernels.grouped_matmul_block_rows`; at ep 1 GSPMD splits the kernel's expert-width values and its "
              "fp32 d_w accumulator over the data axes like the fsdp-split expert weights, so the layer's experts "
              "are never gathered whole. The peak is the larger of the backward (padded rows [P, D], six [P, F / 8] "
              "buffers, the fp32 [E, D / 8, F] accumulator, one loop chunk) and the recomputed forward's down "
              "projection (sorted rows [R, D] and its padded output [P, D]).",
              "- **pallas**: the padded rows, output gradient and input gradient whole, d_w in the weights' dtype "
              "(GSPMD runs the custom call whole on every device).",
              "- **ragged_dot**: XLA:GPU's dense lowering, a masked [experts, rows, width] copy per matmul. Which "
              "copies are live at the peak is **fitted, not derived**: at ep 1 three expert-width copies and the "
              "rows up to 8 GiB per copy, the rows twice and the expert-width copies split over the data axes "
              "above (WHOLE_COPY_LIMIT, fitted on the ep-1 compiles of the previous version of this page); inside "
              "the ep shard_map the rows twice and four expert-width copies, three row copies above the limit "
              "(observed on the Qwen3 ep rows); the ragged_dot checks below keep it honest.",
              "- **blocked with ep > 1**: inside the shard_map nothing is split: the padded rows three times "
              "[P, D], the received rows [R, D] twice, six [P, F], the fp32 [E / ep, D, F] accumulator.",
              "- **ep > 1**: each device receives ep x C rows (C = tokens x min(k, E / ep) dropless, "
              "ceil(c x tokens x k / ep) with `model.moe_capacity_factor` c), holds the [ep, C, D] send and receive "
              "buffers, E / ep experts whole; the cost model moves the padded buffers 4 times a layer "
              "(dispatch / combine, forward / backward) and gathers the non-expert weights over dp x fsdp x ep.",
              "", "Known gaps of the bill (estimated vs compiled above): Mixtral-8x7B with the optimizer on the host "
              "at seq >= 65536 is over-estimated by a quarter to a third (the backward's six expert-width padded "
              "buffers are not all live at that length: explain shows two); the Qwen3 rows whose peak is the loss "
              "(151936-token vocabulary, short sequences) by 12-16%; dropless ep 8 with the optimizer on the host at "
              "seq 32768 by 21-22%; tiny-moe's ep rows (a few MiB, dominated by "
              "small buffers) by 8-26% under; the QLoRA rows are under-estimated: by 10-12% untiled (the "
              "adapters' fp32 [P, D] output gradient padded for the grouped matmul) and by 27% for gpt-oss at 1M "
              "tokens in tiles, where the peak is the attention backward's whole-sequence q-sized buffers "
              "(q, its gradient, the context and its gradient: 4 x 8 GiB), which the bill's MLP-phase working set "
              "does not count."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        name, seq, ep = argv[1], int(argv[2]) or None, int(argv[3])
        print("RESULT" + json.dumps(child_run(name, seq, ep)), flush=True)
        return 0
    ep = int(argv[argv.index("--ep") + 1]) if "--ep" in argv else 1
    only = [argv[i + 1] for i, a in enumerate(argv) if a == "--only"]
    path = OUT / ("moe.json" if ep == 1 else f"moe-ep{ep}.json")
    saved = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
    order = ROWS + CHECKS
    if "--from-json" not in argv:
        for row in order:
            if only and row["name"] not in only or ep > 1 and _sets_ep(row):
                continue
            saved[row["name"]] = plan_row(row, ep)
            path.write_text(json.dumps([saved[r["name"]] for r in order if r["name"] in saved], indent=1))
            print(f"{row['name']}: done", flush=True)
    else:  # the compiled figures kept, the bill and cost model recomputed from this tree
        for row in order:
            r = saved.get(row["name"])
            if r and "refused" not in r:
                r.update(analytic(row, r["seq_len"] if row.get("search") else None, ep))
                for seq, tried in r.get("search", {}).items():
                    tried["analytic_bytes"] = analytic(row, int(seq), ep)["analytic_bytes"]
        path.write_text(json.dumps([saved[r["name"]] for r in order if r["name"] in saved], indent=1))
    _write_page(order)
    return 0


def _write_page(order: list[dict]) -> None:
    """benchmarks/moe.md: every row of moe.json, each followed by its expert-parallel twin from moe-ep*.json."""
    pages = [json.loads(p.read_text()) for p in [OUT / "moe.json", *sorted(OUT.glob("moe-ep*.json"))] if p.exists()]
    by_name = [{r["name"]: r for r in page} for page in pages]
    rows = [page[r["name"]] for r in order for page in by_name if r["name"] in page]
    (OUT / "moe.md").write_text(render(rows))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
