"""The device check for the fused host AdamW kernel in a GPU program's host computation (kernels.host_update).

On one GPU (`PYTHONPATH=. python3 scripts/gpu_host_update_check.py OUT.json`), with the optimizer state in
pinned host memory and the update on the host:
1. numerics: configs/tiny.yaml for 6 steps through XLA's update and through the kernel; the losses must agree
   within 1e-4 (relative), as they do on CPU (tests/unit/test_host_adamw.py);
2. speed: a bigger model (default llama3-8b cut to 4 layers, seq 2048) for a few steps each way; the median
   step time of each, measured on the device the script runs on.
What it prints is measured on that device. `kernels.host_update=auto` keeps XLA's update on GPUs until this
check has passed there. On a CPU machine it runs the same steps on the CPU (the speed part with --preset tiny).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
HOST = ["offload.optimizer=host", "offload.optimizer_update=host", "precision.param_dtype=bfloat16",
        "precision.master_weights=true", "parallel.fsdp=1", "train.progress=false", "train.log_every=1",
        "checkpoint.enabled=false", "data.kind=synthetic"]


def _records(out_dir: Path, impl: str, overrides: list[str]) -> list[dict]:
    from jaxmem.loader import load_config
    from jaxmem.train import run

    cfg = load_config(CONFIG, [f"out_dir={out_dir / impl}", *HOST, f"kernels.host_update={impl}", *overrides])
    return run(cfg)["records"]


def check(out_dir: Path, preset: str, layers: int, seq_len: int, steps: int) -> dict:
    import jax

    tiny = ["model.n_layers=2", "train.seq_len=64", "train.micro_batch=2", "train.steps=6"]
    losses = {impl: [r["loss"] for r in _records(out_dir / "numerics", impl, tiny)] for impl in ("xla", "fused")}
    worst = max(abs(a / b - 1) for a, b in zip(losses["fused"], losses["xla"]))
    big = [f"model.preset={preset}", f"model.n_layers={layers}", f"train.seq_len={seq_len}", "train.micro_batch=1",
           f"train.steps={steps}", "remat.preset=full"]
    times = {}
    for impl in ("xla", "fused"):
        records = _records(out_dir / "speed", impl, big)[1:]  # the first step compiles
        times[impl] = statistics.median(r["step_time_s"] for r in records)
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(), "jax": jax.__version__,
            "how": f"measured on {jax.default_backend()}", "losses": losses, "worst_relative_loss_gap": worst,
            "numerics_ok": worst <= 1e-4, "speed_config": big, "median_step_s": times,
            "fused_speedup": times["xla"] / times["fused"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="where the figures go")
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = check(Path(tmp), args.preset, args.layers, args.seq_len, args.steps)
    args.json.write_text(json.dumps(result, indent=1))
    verdict = "ok" if result["numerics_ok"] else "FAIL"
    print(f"numerics: {verdict} (worst loss gap {result['worst_relative_loss_gap']:.2e})")
    print(f"median step, {result['how']} ({result['device']}): xla {result['median_step_s']['xla']:.3f} s, "
          f"fused {result['median_step_s']['fused']:.3f} s ({result['fused_speedup']:.2f}x)")


if __name__ == "__main__":
    main()
