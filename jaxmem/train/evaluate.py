"""Held-out evaluation during training: the summed next-token loss over `eval.batches` global batches of the
records at `eval.path` (the same kind, format and packing as the training data), run on the training mesh
with the training kernels. The batches are the first ones of the held-out set, the same at every
evaluation, so the figures of a run (and of a resumed run) compare step to step."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxmem.core import offload
from jaxmem.io.data import Batches, make_source
from jaxmem.config.schema import Config
from jaxmem.core.program import TrainProgram, loss_sum_fn, split_batch


def eval_step(prog: TrainProgram):
    """jitted fn(params, batch) -> (loss sum, valid labels) over every micro-batch of a global batch."""
    cfg, prec = prog.cfg, prog.precision
    token_loss = loss_sum_fn(prog)

    def step(params, base, batch):
        params = offload.cast_for_grad(cfg, params, prec.grad_reduce)

        def one(carry, micro):
            loss_sum, n_valid = token_loss(params, *micro, base=base)
            return (carry[0] + loss_sum, carry[1] + n_valid.astype(jnp.float32)), None

        (loss_sum, n_valid), _ = jax.lax.scan(one, (jnp.float32(0.0), jnp.float32(0.0)), split_batch(batch))
        return loss_sum, n_valid

    batch = {key: prog.batch_sharding for key in prog.batch_keys}
    return jax.jit(step, in_shardings=(prog.state_shardings["params"], prog.state_shardings.get("base"), batch))


@dataclasses.dataclass
class Evaluator:
    """Evaluates every `eval.every` steps and at the last step."""

    cfg: Config
    prog: TrainProgram
    batches: list  # the held-out global batches, built once (sharded device arrays)
    step_fn: object = None

    @classmethod
    def for_run(cls, cfg: Config, prog: TrainProgram) -> "Evaluator | None":
        if not cfg.eval.path:
            return None
        source = make_source(cfg, path=cfg.eval.path, key="eval.path")
        data = Batches(source, prog)
        return cls(cfg, prog, [next(data) for _ in range(cfg.eval.batches)])

    def due(self, done: int, total: int) -> bool:
        every = self.cfg.eval.every
        return done == total or bool(every and done % every == 0)

    def run(self, state: dict) -> dict:
        """eval_loss (mean over the held-out valid labels), eval_ppl = exp(eval_loss), eval_tokens."""
        if self.step_fn is None:
            if hasattr(self.prog, "eval_loss"):  # a pipeline evaluates stage by stage
                self.step_fn = self.prog.eval_loss
            else:
                fn = eval_step(self.prog)
                self.step_fn = lambda state, batch: fn(state["params"], state.get("base"), batch)
        total, count = 0.0, 0.0
        for batch in self.batches:
            loss_sum, n_valid = jax.device_get(self.step_fn(state, batch))
            total, count = total + float(loss_sum), count + float(n_valid)
        loss = total / max(count, 1.0)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 80.0)), "eval_tokens": int(count)}
