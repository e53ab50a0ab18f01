"""The pipeline train program: one Stage per group of devices, driven through a schedule from Python.

Every process runs the same driver: it issues the passes of the stages it drives and the transfers it
takes part in, in the schedule's global order, so a pipeline can span processes (one stage per node).
JAX dispatch is asynchronous, so stages on different devices run at the same time.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.mesh import sharding
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.core.layout import Layout
from jaxmem.model import init_model
from jaxmem.optim.hyper import schedule as lr_schedule
from jaxmem.optim.layerwise import adam_count
from jaxmem.pipeline import partition, schedule as schedules
from jaxmem.pipeline.checkpoints import PP_META, on_cpu_host, restore_pipeline
from jaxmem.pipeline.stage_store import STAGES
from jaxmem.pipeline.stage import Stage, stats_size
from jaxmem.pipeline.transfer import Link, leads, owns
from jaxmem.core.step_state import assemble_state, split_batch
from jaxmem.io.data import batch_keys
from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import Features
from jaxmem.model import abstract_model
from jaxmem.model.moe import expert_count, is_moe
from jaxmem.pipeline.checkpoints import whole_params
from jaxmem.core.checkpoint import read_model_params


@dataclasses.dataclass
class PipelineProgram:
    cfg: Config
    counts: tuple[int, ...]
    stages: list[Stage]
    schedule: schedules.Schedule

    # ------------------------------------------------------------ shared with TrainProgram
    @property
    def grad_accum(self) -> int:
        return self.stages[0].prog.grad_accum

    @property
    def rows(self) -> int:
        return self.stages[0].prog.rows

    @property
    def layout(self) -> Layout:
        """The first stage's layout with the whole model's params (what parameter counts read)."""
        return dataclasses.replace(self.stages[0].prog.layout, abstract_params=self.abstract_model_params(),
                                   model_abstract_params=self.abstract_model_params())

    @property
    def batch_keys(self) -> tuple[str, ...]:
        return batch_keys(self.cfg)

    @property
    def batch_shape(self) -> tuple[int, int, int]:
        return self.stages[0].prog.batch_shape

    @property
    def batch_sharding(self) -> NamedSharding:
        """Rows as this process reads them: every row of the batch (its stages take all of them)."""
        mesh = next((s.mesh for s in self.stages if owns(s.mesh)), self.stages[0].mesh)
        return NamedSharding(mesh, P(None, sharding.batch_spec(mesh)[0], None))

    def shard_batch(self, local) -> dict:
        """The batch stays on the host; each stage takes its micro-batches' arrays when it runs them."""
        local = local if isinstance(local, dict) else {"tokens": local}
        if set(local) != set(self.batch_keys):
            raise ValueError(f"batch has {sorted(local)}, the step takes {list(self.batch_keys)}")
        return {k: np.asarray(v, np.int32) for k, v in local.items()}

    # ------------------------------------------------------------ state
    def stage_templates(self) -> list[dict]:
        return [s.prog.abstract_state for s in self.stages]

    @property
    def abstract_state(self) -> dict:
        return {"stages": self.stage_templates()}

    def model(self, state: dict) -> nnx.Module:
        """The whole model (host arrays) of a pipeline state: for jaxmem.io.hf.save_hf and inference."""
        graphdef = nnx.split(abstract_model(self.cfg.model))[0]
        params = partition.merge_tree([jax.device_get(st["params"]) for st in state["stages"]],
                                      self.abstract_model_params())
        return nnx.merge(graphdef, params)

    def abstract_model_params(self) -> dict:
        return whole_params(self.cfg)

    def init_state(self, seed: int | None = None) -> dict:
        seed = self.cfg.train.seed if seed is None else seed
        return {"stages": [self._stage_init(s, seed) for s in self.stages]}

    def _stage_init(self, stage: Stage, seed: int):
        if not owns(stage.mesh):
            return None
        prog = stage.prog

        def fresh():
            params = nnx.to_pure_dict(nnx.split(init_model(self.cfg.model, seed=seed,
                                                           param_dtype=prog.precision.param))[1])
            params = partition.stage_params(self.cfg, params, self.counts, stage.index)
            return assemble_state(prog.cfg, prog.precision, prog.optimizer, params)

        return jax.jit(fresh, out_shardings=prog.state_shardings)()

    def state_from_whole(self, whole: dict) -> dict:
        """Stage states cut from a whole-model train state or params tree of host arrays (a non-pp checkpoint,
        init_from, an HF import), placed on each stage's shardings."""
        templates = self.stage_templates()
        if set(whole) != {"params"}:
            pieces = partition.split_tree(whole, templates, self.counts)
        else:  # params only: a fresh optimizer state around them
            params_templates = [t["params"] for t in templates]
            pieces = [self._assemble(s, p) for s, p in zip(self.stages, partition.split_tree(
                whole["params"], params_templates, self.counts))]
        return {"stages": [jax.device_put(p, s.prog.state_shardings) if owns(s.mesh) else None
                           for p, s in zip(pieces, self.stages)]}

    def _assemble(self, stage: Stage, params):
        prog = stage.prog
        return jax.device_get(jax.jit(lambda p: assemble_state(prog.cfg, prog.precision, prog.optimizer, p))(params))

    def whole_state(self, state: dict, whole_template: dict) -> dict:
        """The whole-model train state (host arrays) laid out as `whole_template` (a non-pp program's)."""
        return partition.merge_tree([jax.device_get(s) for s in state["stages"]], whole_template)

    # ------------------------------------------------------------ step
    @functools.cached_property
    def links(self) -> "Links":
        return Links(self)

    def jit_step(self):
        return PipelineStep(self)

    def eval_loss(self, state: dict, batch: dict) -> tuple[float, float]:
        """(loss sum, valid labels) of a batch, forward only, one micro-batch at a time through the stages."""
        inputs, labels, segment_ids, positions = split_batch(batch)
        loss_sum, count = None, None
        for m in range(inputs.shape[0]):
            x = None
            for stage, st in zip(self.stages, state["stages"]):
                out = None
                if owns(stage.mesh):
                    x = _put(stage, inputs, m) if stage.first else x
                    extras = (_put(stage, labels, m) if stage.last else None, _put(stage, segment_ids, m),
                              _put(stage, positions, m))
                    out = stage.evaluate(st["params"], x, extras)
                if stage.last:
                    if out is not None:
                        loss_sum = out[0] if loss_sum is None else loss_sum + out[0]
                        count = out[1] if count is None else count + out[1]
                else:
                    x = self.links.ahead[stage.index].send(out)
        counted = loss_sum is not None and leads(self.stages[-1].mesh)
        total = _sum_over_processes([float(loss_sum), float(count)] if counted else [0.0, 0.0])
        return float(total[0]), float(total[1])

    def lower(self):
        raise ConfigError("parallel.pp: a pipeline is one program per stage; see jaxmem.pipeline.plan")

    # ------------------------------------------------------------ run hooks (jaxmem.core.plugins.RunProgram)
    state_item = STAGES  # each process writes the stages it drives

    def checkpoint_meta(self) -> dict:
        return {PP_META: list(self.counts)}  # a resume with other counts, pp or none re-cuts the state

    def restore_run(self, ckpts, step: int | None, required_meta: tuple[str, ...] = ()) -> tuple[dict, dict]:
        return restore_pipeline(self, ckpts, step, required_meta)

    def init_from(self, path) -> dict:
        """Read on the host, cut per stage."""
        params = read_model_params(self.cfg, path, on_cpu_host(self.abstract_model_params()))
        return self.state_from_whole({"params": jax.tree.map(np.asarray, params)})

    def compile_step(self):
        return self.jit_step()  # the stage programs compile at their first call


def build_pipeline(cfg: Config, devices: Sequence | None = None, counts: Sequence[int] | None = None,
                   *, check: bool = True, features: Features) -> PipelineProgram:
    """The stages of `cfg` (parallel.pp > 1) on `devices` (default: all), with `counts` layers per stage
    (default: parallel.pp_layers; with `auto` the caller passes the balancer's counts,
    jaxmem.pipeline.balance.stage_counts). `check=False` lets the counts not sum to the model's layers (the
    balancer's probes, which are compiled, never run). `features`: the registry's, as each stage's program is
    built with them (jaxmem.registry.build_pipeline hands them)."""
    meshes = sharding.stage_meshes(cfg.parallel, devices)
    if counts is None:
        counts = partition.layer_counts(cfg)
    if counts is None:
        raise ConfigError("parallel.pp_layers=auto: build_pipeline needs the balancer's layer counts "
                          "(counts=jaxmem.pipeline.balance.stage_counts(cfg, devices, features))")
    if check:
        partition.check_counts(counts, cfg.parallel.pp, cfg.model.n_layers)
    stages = [Stage(cfg, s, k, partition.stage_keys(cfg, s), mesh, features)
              for s, (k, mesh) in enumerate(zip(counts, meshes))]
    sched = schedules.build(cfg.parallel.pp_schedule, cfg.parallel.pp, stages[0].prog.grad_accum)
    return PipelineProgram(cfg, tuple(counts), stages, sched)


class Links:
    """The transfers between neighbouring stages: activations ahead, cotangents back, and (tied embeddings)
    the embedding's gradient between the first and the last stage."""

    def __init__(self, prog: PipelineProgram):
        stages = prog.stages
        dtype = stages[0].prog.precision.compute
        shape = stages[0].activation_shape
        self.ahead = [Link(a.mesh, b.mesh, shape, dtype, b.activation.spec) for a, b in zip(stages, stages[1:])]
        self.back = [Link(b.mesh, a.mesh, shape, dtype, a.activation.spec, reverse=True)
                     for a, b in zip(stages, stages[1:])]
        if is_moe(prog.cfg.model):  # the router statistics (and their cotangents) travel beside h
            n = (stats_size(expert_count(prog.cfg.model)),)
            self.ahead = [_WithStats(h, Link(a.mesh, b.mesh, n, jnp.float32, P()))
                          for h, a, b in zip(self.ahead, stages, stages[1:])]
            self.back = [_WithStats(h, Link(b.mesh, a.mesh, n, jnp.float32, P(), reverse=True))
                         for h, a, b in zip(self.back, stages, stages[1:])]
        self.embed = None
        if prog.cfg.model.tie_embeddings:
            first, last = stages[0], stages[-1]
            embed = first.prog.abstract_state["params"]["embed"]
            spec = first.prog.grad_specs["embed"]
            self.embed = (Link(first.mesh, last.mesh, embed.shape, jnp.float32, spec),
                          Link(last.mesh, first.mesh, embed.shape, jnp.float32, spec, reverse=True))


class _WithStats:
    """A mixture of experts' transfer: (hidden states, packed router statistics) over two links."""

    def __init__(self, hidden: Link, stats: Link):
        self.hidden, self.stats = hidden, stats

    def send(self, x):
        h, packed = (None, None) if x is None else x
        return self.hidden.send(h), self.stats.send(packed)


class PipelineStep:
    """step(state, batch) -> (state, metrics), like TrainProgram.jit_step()'s."""

    def __init__(self, prog: PipelineProgram):
        self.prog = prog
        self.links = prog.links
        self.tied = prog.cfg.model.tie_embeddings
        self.lr_at = lr_schedule(prog.cfg)
        self.add = jax.jit(lambda a, b: a + b)

    def __call__(self, state: dict, batch: dict):
        prog, stages = self.prog, self.prog.stages
        mine = [owns(s.mesh) for s in stages]
        inputs, labels, segment_ids, positions = split_batch(batch)
        n_valid = np.float32(max(int(np.sum(labels != IGNORE_INDEX)), 1))

        params = [s.params_for_grad(st["params"]) if own else None for s, st, own in zip(stages, state["stages"], mine)]
        grads = [s.zero_grads() if own else None for s, own in zip(stages, mine)]
        received: dict = {}
        residuals: dict = {}
        loss_sums, routers = [], []
        ct_last = jnp.float32(1.0) / n_valid
        for s, op, m in prog.schedule.order:
            stage = stages[s]
            if op == schedules.FORWARD:
                out = None
                if mine[s]:
                    x = _put(stage, inputs, m) if stage.first else received.pop(("F", s, m))
                    extras = (_put(stage, labels, m) if stage.last else None,
                              _put(stage, segment_ids, m), _put(stage, positions, m))
                    out, residuals[(s, m)] = stage.forward(params[s], x, extras)
                    if stage.last:
                        if stage.experts:  # (loss sum, router losses)
                            out, router = out
                            routers.append(router)
                        loss_sums.append(out)
                if not stage.last:
                    moved = self.links.ahead[s].send(out)
                    if mine[s + 1]:
                        received[("F", s + 1, m)] = moved
            else:
                dx = None
                if mine[s]:
                    ct = jax.device_put(ct_last, NamedSharding(stage.mesh, P())) if stage.last \
                        else received.pop(("B", s, m))
                    grads[s], dx = stage.backward(params[s], residuals.pop((s, m)), ct, grads[s])
                if not stage.first:
                    moved = self.links.back[s - 1].send(dx)
                    if mine[s - 1]:
                        received[("B", s - 1, m)] = moved
        if self.tied:
            grads = self._sum_tied_embedding(grads, mine)
        sums = [s.grad_sums(g) if own else None for s, g, own in zip(stages, grads, mine)]
        if self.tied and mine[-1]:  # the embedding's gradient is counted once
            sums[-1] = sums[-1] - stages[-1].grad_sums({"embed": grads[-1]["embed"]})
        loss_sum = None
        if mine[-1]:  # summed in micro-batch order from 0, as the one-program step's scan does
            loss_sum = jnp.float32(0.0)
            for value in loss_sums:
                loss_sum = loss_sum + value
        norm, loss_sum = _gather_scalars([x for x, s in zip(sums, stages) if x is not None and leads(s.mesh)],
                                         loss_sum if leads(stages[-1].mesh) else None)
        new = []
        for s, st, g, own in zip(stages, state["stages"], grads, mine):
            new.append(s.update(st, g, jnp.float32(norm)) if own else None)
        count = next(adam_count(st["opt"]) for st, own in zip(new, mine) if own)
        metrics = {"loss": np.float32(loss_sum / n_valid), "grad_norm": np.float32(norm),
                   "lr": self.lr_at(jnp.maximum(jax.device_get(count) - 1, 0)), "tokens": n_valid,
                   "update_skipped": np.bool_(False), "loss_scale": np.float32(1.0)}
        if is_moe(prog.cfg.model):  # the micro-batches' mean, as the one-program step reports them
            metrics.update(_router_means(routers, leads(stages[-1].mesh)))
        return {"stages": new}, metrics

    def _sum_tied_embedding(self, grads, mine):
        to_last, to_first = self.links.embed
        g0 = grads[0]["embed"] if mine[0] else None
        gl = grads[-1]["embed"] if mine[-1] else None
        at_last, at_first = to_last.send(g0), to_first.send(gl)
        if mine[0]:
            grads[0] = dict(grads[0], embed=self.add(g0, at_first))
        if mine[-1]:
            grads[-1] = dict(grads[-1], embed=self.add(at_last, gl))
        return grads


def _router_means(routers: list, reports: bool) -> dict:
    """{"moe_aux_loss", "moe_z_loss"}: the mean over micro-batches of the last stage's router losses (this
    process's, where it leads the last stage), summed over processes."""
    keys = ("moe_aux_loss", "moe_z_loss")
    local = [sum(float(r[k]) for r in routers) / max(len(routers), 1) if reports else 0.0 for k in keys]
    return {k: np.float32(v) for k, v in zip(keys, _sum_over_processes(local))}


def _put(stage: Stage, array, m: int):
    """Micro-batch m of a host batch array on the stage's mesh (None stays None)."""
    return None if array is None else jax.make_array_from_process_local_data(stage.rows, array[m])


def _sum_over_processes(values) -> np.ndarray:
    """Per-process values summed over every process (the stages a process drives hold its part)."""
    local = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, local.size).sum(0)


def _gather_scalars(sums: list, loss_sum) -> tuple[float, float]:
    """(global gradient norm, the step's loss sum) from the stages' squared-gradient sums and loss sum this
    process reports (it leads their meshes), summed over every process."""
    sq, loss = _sum_over_processes([sum(float(x) for x in sums), float(loss_sum) if loss_sum is not None else 0.0])
    return float(np.sqrt(np.float32(sq))), float(loss)
