"""Held-out evaluation during training: the summed next-token loss over the records at `eval.path` (the same
kind, format and packing as the training data), read once: the first `eval.batches` global batches at most,
fewer where the held-out set ends sooner, run on the training mesh with the training kernels. The batches are
the same at every evaluation, so the figures of a run (and of a resumed run) compare step to step.

A batch runs past the set's end when the set is not a whole number of batches (or smaller than one): records
then get no labels in the rows past the end (every held-out token counted once); a token stream (text, bin)
cannot mask them, so its extra windows are read again and the log says how many (eval_tokens still counts each
token once)."""
from __future__ import annotations

import dataclasses
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.core import offload
from jaxmem.io.data import Batches, RecordSource, make_source
from jaxmem.io.documents.packing import IGNORE_INDEX
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
    distinct_tokens: int | None = None  # a token stream's labels, each counted once (records: masked instead)

    @classmethod
    def for_run(cls, cfg: Config, prog: TrainProgram) -> "Evaluator | None":
        if not cfg.eval.path:
            return None
        source = make_source(cfg, path=cfg.eval.path, key="eval.path")
        data = Batches(source, prog)
        distinct = source.rows.n_rows if isinstance(source, RecordSource) else source.n_windows
        count = min(cfg.eval.batches, -(-distinct // data.per_step))
        batches = [prog.shard_batch(_read_once(data, i * data.per_step, distinct)) for i in range(count)]
        extra = count * data.per_step - distinct
        if isinstance(source, RecordSource) or extra <= 0:
            return cls(cfg, prog, batches)
        print(f"jaxmem eval: {cfg.eval.path}: {distinct} windows of {cfg.train.seq_len} tokens fill {count} "
              f"batch(es) of {data.per_step}; the other {extra} rows read those windows again (a token stream has "
              "no labels to mask), eval_tokens counts each token once", file=sys.stderr, flush=True)
        return cls(cfg, prog, batches, distinct_tokens=distinct * cfg.train.seq_len)

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
        tokens = int(count) if self.distinct_tokens is None else min(int(count), self.distinct_tokens)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 80.0)), "eval_tokens": tokens}


def _read_once(data: Batches, position: int, distinct: int):
    """This process's rows of the held-out batch at `position`; records' rows past the set's `distinct` rows
    (which would wrap round to its start) keep no labels."""
    local = data.local_batch(position)
    if not isinstance(local, dict):
        return local
    past_end = data.sample_indices(position) >= distinct
    return dict(local, labels=np.where(past_end[..., None], IGNORE_INDEX, local["labels"]).astype(np.int32))
