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
from jaxmem.core.objective import reference_logprobs
from jaxmem.core.plugins import FROZEN, REFERENCE_KEY
from jaxmem.io.data import Batches, RecordSource, make_source
from jaxmem.io.documents.packing import IGNORE_INDEX
from jaxmem.config.schema import Config
from jaxmem.core.program import TrainProgram, loss_sum_fn, split_batch, stage_fn


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


def objective_eval_step(prog: TrainProgram, chosen):
    """jitted fn(params, frozen, batch) -> (pairs, loss sum, {metric: sum}) of an objective other than the
    next-token loss (jaxmem.core.plugins.Objective: a preference loss), each micro-batch's shares weighted by
    its pairs so that the sums over batches divide by the pairs into means over every held-out pair."""
    cfg, prec = prog.cfg, prog.precision
    logprob_fn = stage_fn(prog, logprobs=True, temperature=chosen.temperature)

    def step(params, frozen, batch):
        params = offload.cast_for_grad(cfg, params, prec.grad_reduce)

        def one(carry, micro):
            segments = None if micro[2] is None else micro[2][None]
            totals = dict(chosen.totals(micro[1][None], segments), scale=jnp.float32(1.0))
            policy = logprob_fn(params, *micro[:4], base=frozen)
            reference = reference_logprobs(prog, chosen, logprob_fn, params, frozen, micro)
            share, metrics = chosen.micro_loss(policy, reference, micro[1], totals, micro[2])
            pairs = totals["pair_count"]
            weighted = {k: v * pairs for k, v in metrics.items()}
            return jax.tree.map(jnp.add, carry, (pairs, share * pairs, weighted)), None

        zero = (jnp.float32(0.0), jnp.float32(0.0), {k: jnp.float32(0.0) for k in chosen.metric_names})
        out, _ = jax.lax.scan(one, zero, split_batch(batch) + (batch.get(REFERENCE_KEY),))
        return out

    batch = {key: prog.batch_sharding for key in prog.batch_keys}
    return jax.jit(step, in_shardings=(prog.state_shardings["params"], prog.state_shardings.get(FROZEN), batch))


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
        distinct = _distinct_rows(source)
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
        """eval_loss (mean over the held-out valid labels), eval_ppl = exp(eval_loss), eval_tokens; with an
        objective of its own (a preference loss) its loss and metrics (eval_rewards/chosen, ...: TRL's names)
        as means over the held-out pairs, and eval_pairs."""
        chosen = self.prog.features.objective(self.cfg)
        if chosen is not None:
            return self._run_objective(state, chosen)
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


    def _run_objective(self, state: dict, chosen) -> dict:
        if self.step_fn is None:
            fn = objective_eval_step(self.prog, chosen)
            self.step_fn = lambda state, batch: fn(state["params"], state.get(FROZEN), batch)
        pairs, loss, sums = 0.0, 0.0, dict.fromkeys(chosen.metric_names, 0.0)
        for batch in self.batches:
            n, loss_sum, metric_sums = jax.device_get(self.step_fn(state, batch))
            pairs, loss = pairs + float(n), loss + float(loss_sum)
            sums = {k: v + float(metric_sums[k]) for k, v in sums.items()}
        mean = lambda x: x / max(pairs, 1.0)  # noqa: E731
        return {"eval_loss": mean(loss), **{f"eval_{k}": mean(v) for k, v in sums.items()}, "eval_pairs": int(pairs)}


def _read_once(data: Batches, position: int, distinct: int):
    """This process's rows of the held-out batch at `position`; records' rows past the set's `distinct` rows
    (which would wrap round to its start) keep no labels."""
    local = data.local_batch(position)
    if not isinstance(local, dict):
        return local
    past_end = data.sample_indices(position) >= distinct
    return dict(local, labels=np.where(past_end[..., None], IGNORE_INDEX, local["labels"]).astype(np.int32))


def _distinct_rows(source) -> int:
    """The held-out rows (a token stream: its windows; preference pairs: two rows each, or their packed rows)."""
    if not isinstance(source, RecordSource):
        return source.n_windows
    return source.rows.n_rows
