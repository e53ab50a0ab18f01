"""Your own training loop over jaxmem's pieces: jaxmem's optimizer and step, gradient accumulation from the
config (train.grad_accum), periodic checkpoints that `jaxmem train` can also resume, and resume itself.

    python scripts/train_own_loop.py configs/tiny.yaml out_dir=runs/own train.steps=20 train.grad_accum=2
"""
import sys

import jaxmem
from jaxmem.runtime import distributed
from jaxmem.cli.train import parse_args


def main(argv: list[str]) -> list[float]:
    path, overrides = parse_args(argv)
    cfg = jaxmem.load_config(path or "configs/tiny.yaml", overrides)  # YAML plus key=value overrides
    distributed.initialize(cfg.distributed)  # multi-process runs join here, before any device use
    prog = jaxmem.build_program(cfg)  # mesh, shardings, jaxmem's optimizer; nothing allocated yet
    ckpts = jaxmem.Checkpoints(f"{cfg.out_dir}/checkpoints", keep=cfg.checkpoint.keep)

    start = ckpts.latest_step() or 0
    if start:  # resume: the state onto this program's shardings, the data where it stopped
        state, meta = ckpts.restore(prog.abstract_state, start)
        data = jaxmem.batches(cfg, prog, start, meta["data_position"])
    else:
        state, data = jaxmem.train_state(prog), jaxmem.batches(cfg, prog)
    step_fn = jaxmem.train_step(prog)  # sums grads over the grad_accum micro-batches, clips, updates
    print(f"batch [grad_accum, rows, seq_len + 1] = {list(prog.batch_shape)}")

    losses = []
    for step in range(start + 1, cfg.train.steps + 1):
        state, metrics = step_fn(state, next(data))  # the state is donated: keep only the returned one
        losses.append(float(metrics["loss"]))
        print(f"step {step}  loss {losses[-1]:.4f}  grad_norm {float(metrics['grad_norm']):.3f}")
        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps:
            meta = jaxmem.run_meta(cfg, step, data.position_at(step), data.per_step)
            ckpts.save(step, state, meta)  # async: returns once the arrays are copied off the devices
    ckpts.close()  # waits for the saves to finish
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
