"""Checkpoint cost on CPU, and the preemption grace period a run needs.

Measured on CPU (this host, 8 virtual devices), for the tiny config and a small one (d_model 512, 8 layers):
  - step time with no saves, with an async save every EVERY steps and with a blocking save every EVERY steps (the
    median `step_time_s` of the steps right after a save, against the median of the run without saves);
  - the time a blocking save of the whole train state takes (save + wait, as SIGTERM's save does), its bytes on
    disk, and the write rate that gives.
Estimated (not measured) for the headline configs: checkpoint bytes from the parameter count and the bytes
each parameter's state takes (params + fp32 master + AdamW m, v; a LoRA run saves its adapters' state only),
and the save time at the write rate measured here and at 1 GB/s (a typical network file system).

Writes benchmarks/checkpoint_cpu.json and .md. Run under the machine-wide lock:
  flock /work/wt/heavy.lock python scripts/bench_checkpoint.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from jaxmem.cli import _cpu_scheduler_flag  # noqa: E402

_cpu_scheduler_flag()

import jax  # noqa: E402

from jaxmem.core.checkpoint import Checkpoints, run_meta  # noqa: E402
from jaxmem.loader import load_config  # noqa: E402
from jaxmem.model.presets import param_count  # noqa: E402
from jaxmem.registry import build_program  # noqa: E402
from jaxmem.train import run  # noqa: E402

STEPS, EVERY = 26, 5
MODELS = {"tiny": [], "small": ["model.d_model=512", "model.n_layers=8", "model.d_ff=1408", "model.n_heads=8",
                                "model.n_kv_heads=4", "model.head_dim=64", "model.vocab_size=4096"]}
HEADLINE = ["configs/llama3-8b-8xh100.yaml", "configs/llama3-8b-1x4090.yaml", "configs/qwen2-72b-8xh100.yaml",
            "configs/lora/llama3-8b-qlora-1x4090.yaml", "configs/lora/llama3-70b-qlora-1xh100.yaml"]
NETWORK_FS = 1e9  # bytes/s


def _overrides(out_dir, model, *extra):
    return [f"out_dir={out_dir}", *MODELS[model], f"train.steps={STEPS}", "train.log_every=1", "train.seq_len=64",
            "train.progress=false", "checkpoint.every_minutes=0", *extra]


def step_times(model: str, tmp: Path) -> dict:
    """Median step time without saves, and right after async / blocking saves every EVERY steps."""
    out = {}
    for name, extra in (("no_saves", ["checkpoint.enabled=false"]),
                        ("async_save", [f"checkpoint.every={EVERY}", "checkpoint.async_save=true"]),
                        ("blocking_save", [f"checkpoint.every={EVERY}", "checkpoint.async_save=false"])):
        records = run(load_config(ROOT / "configs/tiny.yaml", _overrides(tmp / f"{model}-{name}", model, *extra)))
        times = {r["step"]: r["step_time_s"] for r in records["records"]}
        steady = [t for s, t in times.items() if s > 2]  # past the first steps' warm-up
        after = [t for s, t in times.items() if s > 2 and (s - 1) % EVERY == 0]
        out[name] = {"median_step_s": statistics.median(steady),
                     "median_step_after_save_s": statistics.median(after) if name != "no_saves" else None}
    return out


def save_time(model: str, tmp: Path, repeats: int = 3) -> dict:
    """A blocking save of the whole state (save + wait), as a SIGTERM's: seconds, bytes, bytes/s."""
    cfg = load_config(ROOT / "configs/tiny.yaml", _overrides(tmp / f"{model}-save", model))
    prog = build_program(cfg)
    state = prog.init_state()
    jax.block_until_ready(state)
    ckpts = Checkpoints(tmp / f"{model}-save" / "checkpoints", keep=repeats + 1, async_save=False)
    seconds = []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        ckpts.save(step, state, run_meta(cfg, step, 0, prog.rows))
        ckpts.wait()
        seconds.append(time.perf_counter() - t0)
    ckpts.close()
    folder = tmp / f"{model}-save" / "checkpoints" / "1"
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    best = min(seconds)
    return {"save_s_median": statistics.median(seconds), "save_s_min": best, "bytes": size,
            "bytes_per_s": size / best}


def disk_rate(tmp: Path, size: int = 256 * 2**20) -> float:
    """Bytes/s of one large file written and fsynced here (what a big checkpoint's shards are bound by)."""
    import numpy as np

    data = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    best = None
    for i in range(2):
        t0 = time.perf_counter()
        with open(tmp / f"disk{i}.bin", "wb") as f:
            f.write(data.tobytes())
            f.flush()
            os.fsync(f.fileno())
        took = time.perf_counter() - t0
        best = took if best is None else min(best, took)
        (tmp / f"disk{i}.bin").unlink()
    return size / best


def state_bytes(path: str) -> tuple[int, str]:
    """(checkpoint bytes, how they were counted) for a config, from its parameter count (an estimate)."""
    cfg = load_config(ROOT / path)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.precision.param_dtype]
    per_param = dtype_bytes + (4 if cfg.precision.master_weights else 0) + 8  # + AdamW m, v in fp32
    if cfg.lora.rank > 0:
        m = cfg.model
        io = {"q_proj": (m.d_model, m.n_heads * m.head_dim), "k_proj": (m.d_model, m.n_kv_heads * m.head_dim),
              "v_proj": (m.d_model, m.n_kv_heads * m.head_dim), "o_proj": (m.n_heads * m.head_dim, m.d_model),
              "gate_proj": (m.d_model, m.d_ff), "up_proj": (m.d_model, m.d_ff), "down_proj": (m.d_ff, m.d_model)}
        named = cfg.lora.targets
        named = named if isinstance(named, (list, tuple)) else [t.strip() for t in str(named).split(",")]
        targets = list(io) if list(named) == ["all-linear"] else named
        n = m.n_layers * sum(cfg.lora.rank * sum(io[t]) for t in targets)
        return n * per_param, f"{n / 1e6:.1f} M adapter parameters x {per_param} B (the frozen base is not saved)"
    n = param_count(cfg.model)
    return n * per_param, f"{n / 1e9:.2f} B parameters x {per_param} B (params, fp32 master, AdamW m and v)"


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="checkpoint cost on CPU and preemption grace estimates")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    models = ap.parse_args().models.split(",")
    results = {"how": "measured on CPU (this host, 8 virtual devices, jax " + jax.__version__ + "); headline rows "
                      "estimated from checkpoint bytes / write rate", "models": {}, "headline": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for model in models:
            results["models"][model] = {"step_times": step_times(model, tmp), "save": save_time(model, tmp)}
        rate = disk_rate(tmp)
    results["disk_bytes_per_s"] = rate
    for path in HEADLINE:
        size, how = state_bytes(path)
        results["headline"].append({"config": path, "bytes": size, "counted_as": how,
                                    "est_save_s_at_disk_rate": size / rate, "est_save_s_at_1GBps": size / NETWORK_FS})
    bench = ROOT / "benchmarks"
    bench.mkdir(exist_ok=True)
    (bench / "checkpoint_cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["# Checkpoint cost and the preemption grace period", "",
             f"Produced by `scripts/bench_checkpoint.py`; {results['how']}.", "",
             "## Step time with saves (measured on CPU)", "",
             f"| model | no saves: median s/step | async save every {EVERY}: s/step after a save | blocking save every "
             f"{EVERY}: s/step after a save | blocking save of the whole state | bytes | write rate |",
             "|---|---|---|---|---|---|---|"]
    for model, r in results["models"].items():
        st, sv = r["step_times"], r["save"]
        lines.append(f"| {model} | {st['no_saves']['median_step_s']:.3f} | "
                     f"{st['async_save']['median_step_after_save_s']:.3f} | "
                     f"{st['blocking_save']['median_step_after_save_s']:.3f} | {sv['save_s_median']:.2f} s | "
                     f"{sv['bytes'] / 1e6:.1f} MB | {sv['bytes_per_s'] / 1e6:.0f} MB/s |")
    for model, r in results["models"].items():
        st = r["step_times"]
        base = st["no_saves"]["median_step_s"]
        after_async = st["async_save"]["median_step_after_save_s"] / base
        lines.append(f"\n{model}: the step after an async save took {after_async:.2f}x the median step without saves, "
                     "after a blocking save "
                     f"{st['blocking_save']['median_step_after_save_s'] / base:.2f}x. On a CPU host the background "
                     "write shares the cores with the step itself; on a GPU the step runs on the device.")
    lines += ["", "## Preemption grace period for the headline configs (estimated, not measured)", "",
              "SIGTERM finishes the current step, then saves the whole train state and waits for it: the grace "
              "period must cover one step plus this save.", "",
              f"This host's disk: {rate / 1e6:.0f} MB/s (measured: a 256 MiB file written and fsynced; the small "
              "models above are bound by per-file overheads instead).", "",
              f"| config | checkpoint bytes (estimated) | counted as | save at {rate / 1e6:.0f} MB/s (this disk) | "
              "save at 1 GB/s |", "|---|---|---|---|---|"]
    for h in results["headline"]:
        lines.append(f"| {h['config']} | {h['bytes'] / 1e9:.1f} GB | {h['counted_as']} | "
                     f"{h['est_save_s_at_disk_rate']:.0f} s | {h['est_save_s_at_1GBps']:.0f} s |")
    (bench / "checkpoint_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
