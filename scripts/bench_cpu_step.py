"""Times the jaxmem train step against a hand-written JAX step of the same tiny model, alternating runs.

Writes benchmarks/cpu_step.json and benchmarks/cpu_step.md. Figures are measured on this machine's CPU.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from handwritten_step import make_step  # noqa: E402

from jaxmem.config import load_config  # noqa: E402
from jaxmem.optim import make_optimizer  # noqa: E402
from jaxmem.program import build_program  # noqa: E402

OVERRIDES = ["parallel.fsdp=1", "train.micro_batch=8", "train.seq_len=128", "optimizer.clip_norm=0",
             "optimizer.weight_decay=0"]
ROUNDS, STEPS_PER_ROUND = 7, 10


def main() -> None:
    cfg = load_config("configs/tiny.yaml", OVERRIDES)
    prog = build_program(cfg, devices=jax.devices()[:1])
    toks = np.random.default_rng(0).integers(0, 256, size=prog.batch_shape).astype(np.int32)
    batch = prog.shard_batch(toks)

    state, jm_step = prog.init_state(), prog.jit_step()
    params = jax.tree.map(lambda x: x.copy(), jax.device_get(state["params"]))
    optimizer = make_optimizer(cfg)
    hw_state = [jax.device_put(params), None]
    hw_state[1] = optimizer.init(hw_state[0])
    hw_step = make_step(optimizer, eps=cfg.model.norm_eps, theta=cfg.model.rope_theta)
    hw_tokens = jax.device_put(toks[0])

    def run_jaxmem():
        nonlocal state
        for _ in range(STEPS_PER_ROUND):
            state, m = jm_step(state, batch)
        jax.block_until_ready(m["loss"])

    def run_handwritten():
        for _ in range(STEPS_PER_ROUND):
            hw_state[0], hw_state[1], loss = hw_step(hw_state[0], hw_state[1], hw_tokens)
        jax.block_until_ready(loss)

    run_jaxmem(), run_handwritten()  # compile and warm up both
    times = {"jaxmem": [], "handwritten": []}
    for _ in range(ROUNDS):  # alternate so drift in machine load hits both alike
        for name, fn in (("jaxmem", run_jaxmem), ("handwritten", run_handwritten)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / STEPS_PER_ROUND)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "how": "measured on CPU (1 device), median of per-round mean step time",
        "machine": f"{platform.machine()} {os.cpu_count()} cores, jax {jax.__version__}",
        "config": "configs/tiny.yaml " + " ".join(OVERRIDES),
        "rounds": ROUNDS, "steps_per_round": STEPS_PER_ROUND,
        "step_time_s": med, "all_times_s": times,
        "ratio_jaxmem_over_handwritten": med["jaxmem"] / med["handwritten"], "target_ratio": 1.10,
    }
    out = Path("benchmarks")
    out.mkdir(exist_ok=True)
    (out / "cpu_step.json").write_text(json.dumps(result, indent=2))
    (out / "cpu_step.md").write_text(
        "# CPU train step: jaxmem vs a hand-written JAX step\n\n"
        f"Measured on CPU ({result['machine']}), tiny model, 1 device, `{result['config']}`; "
        f"{ROUNDS} alternating rounds of {STEPS_PER_ROUND} steps, median.\n\n"
        "| step | median step time (ms, measured on CPU) |\n|---|---|\n"
        f"| jaxmem (`TrainProgram.jit_step`) | {med['jaxmem'] * 1e3:.2f} |\n"
        f"| hand-written (`scripts/handwritten_step.py`) | {med['handwritten'] * 1e3:.2f} |\n\n"
        f"Ratio jaxmem / hand-written: **{result['ratio_jaxmem_over_handwritten']:.3f}** (target <= 1.10).\n")
    print(json.dumps({k: result[k] for k in ("step_time_s", "ratio_jaxmem_over_handwritten")}, indent=2))


if __name__ == "__main__":
    main()
