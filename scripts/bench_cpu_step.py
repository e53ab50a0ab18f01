"""Times the jaxmem train step against a hand-written JAX step of the same tiny model, and against an own-loop
step built from the library pieces (jaxmem.api: loss_fn + optimizer + jax.value_and_grad + jax.jit, as in
docs/library.md), alternating runs.

Writes benchmarks/cpu_step.json and benchmarks/cpu_step.md. Figures are measured on this machine's CPU.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from handwritten_step import make_step  # noqa: E402

from jaxmem import api  # noqa: E402
from jaxmem.loader import load_config  # noqa: E402
from jaxmem.optim.choice import make_optimizer  # noqa: E402
from jaxmem.registry import build_program  # noqa: E402

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

    # The own-loop step of docs/library.md (scripts/train_own_optimizer.py) with jaxmem's optimizer: the
    # same math as jit_step here (clip_norm=0, grad_accum=1), whole-tree optax update instead of layer-wise.
    loss_fn, own_opt, param_shardings = api.loss_fn(prog), api.optimizer(cfg), prog.state_shardings["params"]

    @functools.partial(jax.jit, in_shardings=(param_shardings, None, None),
                       out_shardings=(param_shardings, None, None), donate_argnums=(0, 1))
    def own_step(p, s, tokens):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, tokens)
        updates, s = own_opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    own_state = [api.place_params(prog, params), None]
    own_state[1] = jax.jit(own_opt.init)(own_state[0])
    own_tokens = batch["tokens"]

    def run_jaxmem():
        nonlocal state
        for _ in range(STEPS_PER_ROUND):
            state, m = jm_step(state, batch)
        jax.block_until_ready(m["loss"])

    def run_handwritten():
        for _ in range(STEPS_PER_ROUND):
            hw_state[0], hw_state[1], loss = hw_step(hw_state[0], hw_state[1], hw_tokens)
        jax.block_until_ready(loss)

    def run_own_loop():
        for _ in range(STEPS_PER_ROUND):
            own_state[0], own_state[1], loss = own_step(own_state[0], own_state[1], own_tokens)
        jax.block_until_ready(loss)

    runs = (("jaxmem", run_jaxmem), ("own_loop", run_own_loop), ("handwritten", run_handwritten))
    for _, fn in runs:  # compile and warm up each
        fn()
    times = {name: [] for name, _ in runs}
    for _ in range(ROUNDS):  # alternate so drift in machine load hits all alike
        for name, fn in runs:
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
        "ratio_own_loop_over_jaxmem": med["own_loop"] / med["jaxmem"],
    }
    def spread(name):
        return f"{min(times[name]) * 1e3:.1f} - {max(times[name]) * 1e3:.1f}"

    out = Path("benchmarks")
    out.mkdir(exist_ok=True)
    (out / "cpu_step.json").write_text(json.dumps(result, indent=2))
    (out / "cpu_step.md").write_text(
        "# CPU train step: jaxmem vs a hand-written JAX step and an own loop on jaxmem.api\n\n"
        f"Measured on CPU ({result['machine']}), tiny model, 1 device, `{result['config']}`; "
        f"{ROUNDS} alternating rounds of {STEPS_PER_ROUND} steps, median.\n\n"
        "| step | median step time (ms, measured on CPU) | fastest - slowest round (ms) |\n|---|---|---|\n"
        f"| jaxmem (`TrainProgram.jit_step`, = `jaxmem.train_step`) | {med['jaxmem'] * 1e3:.2f} | "
        f"{spread('jaxmem')} |\n"
        f"| own loop (`jaxmem.loss_fn` + `jaxmem.optimizer`, jitted by hand; docs/library.md) | "
        f"{med['own_loop'] * 1e3:.2f} | {spread('own_loop')} |\n"
        f"| hand-written (`scripts/handwritten_step.py`) | {med['handwritten'] * 1e3:.2f} | "
        f"{spread('handwritten')} |\n\n"
        f"Ratio jaxmem / hand-written: **{result['ratio_jaxmem_over_handwritten']:.3f}** (target <= 1.10). "
        f"Ratio own loop / jaxmem: **{result['ratio_own_loop_over_jaxmem']:.3f}** (measured on CPU; the own "
        "loop's optax update runs on the whole tree at once, jaxmem's layer by layer). The last column is the "
        "round-to-round spread on this shared machine: a difference between medians smaller than it is not a "
        "measurable one.\n")
    print(json.dumps({k: result[k] for k in ("step_time_s", "ratio_jaxmem_over_handwritten",
                                             "ratio_own_loop_over_jaxmem")}, indent=2))


if __name__ == "__main__":
    main()
