"""A hand-written training loop on jaxmem's pieces: config, program, data, checkpoints.

docs/library.md goes further: gradient accumulation, periodic checkpoints and resume
(scripts/train_own_loop.py), your own optax optimizer and numpy batches (scripts/train_own_optimizer.py).

    JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python scripts/train_example.py configs/tiny.yaml out_dir=runs/example train.steps=20
"""
import sys

import jax
import numpy as np

from jaxmem.runtime import distributed
from jaxmem.core.checkpoint import Checkpoints, run_meta
from jaxmem.loader import load_config
from jaxmem.io.data import batches
from jaxmem.registry import build_program
from jaxmem.cli.train import parse_args


def main(argv: list[str]) -> None:
    path, overrides = parse_args(argv)
    cfg = load_config(path or "configs/tiny.yaml", overrides)  # YAML file plus key=value overrides
    distributed.initialize(cfg.distributed)  # multi-process runs join here, before any device use
    prog = build_program(cfg)  # mesh, model, shardings and optimizer; nothing allocated yet
    state, step_fn, data = prog.init_state(), prog.jit_step(), batches(cfg, prog)
    for step in range(1, cfg.train.steps + 1):
        state, metrics = step_fn(state, next(data))  # the state is donated: use only the returned one
        print(f"step {step}  loss {float(metrics['loss']):.4f}")

    ckpts = Checkpoints(f"{cfg.out_dir}/checkpoints", keep=2)
    ckpts.save(cfg.train.steps, state, run_meta(cfg, cfg.train.steps, data.position, data.per_step))
    ckpts.wait()
    restored, meta = ckpts.restore(prog.abstract_state)  # onto this program's shardings
    same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)))
    print(f"restored step {meta['step']} from {ckpts.directory}: {'identical' if same else 'DIFFERENT'}")
    ckpts.close()
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
