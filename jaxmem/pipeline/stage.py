"""One pipeline stage: a train program of its own (its layers, its end params, its mesh) and the four
functions the schedule runs on it: forward, backward, gradient norm and update.

The forward returns the pass's residuals (what the backward needs, as the remat policy leaves them) to the
driver, which holds them until the micro-batch's backward: so a stage's memory is its state plus the
residuals of the micro-batches in flight (1F1B: at most pp - s), and a stage with fewer layers holds less.
Residuals that are just the stage's params are not returned (they would be copies): the backward takes
the params again and puts them back in place.

A mixture of experts' load-balancing loss pools the router statistics of every layer (jaxmem.model.moe), so a
stage hands on (hidden states, its running statistics packed in one fp32 vector) and takes their cotangents
back; the last stage adds the weighted router losses to its loss as the one-program step does, and reports
them with its loss sum.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.core import offload

from jaxmem.mesh import sharding
from jaxmem.model.layers import ACT_BTD
from jaxmem.model.moe import expert_count
from jaxmem.optim.host_update import whole_update
from jaxmem.optim.layerwise import layerwise_update
from jaxmem.core.program import TrainProgram, build_program, rounding_key, stage_fn
from jaxmem.config.schema import Config


def stage_config(cfg: Config, n_layers: int) -> Config:
    """The config of one stage's program: its layer count, no pipeline."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers),
                               parallel=dataclasses.replace(cfg.parallel, pp=1, pp_layers="even"))


@dataclasses.dataclass
class _Residuals:
    """How a forward's vjp closure is rebuilt: its tree, and for each leaf the index of the param leaf it is
    (or None: returned by the forward). Filled while the forward is traced."""
    treedef: object = None
    sources: tuple = ()


class Stage:
    def __init__(self, cfg: Config, index: int, n_layers: int, keys: tuple[str, ...], mesh, features):
        self.index, self.n_layers, self.keys = index, n_layers, keys
        self.first, self.last = index == 0, index == cfg.parallel.pp - 1
        self.prog: TrainProgram = build_program(stage_config(cfg, n_layers), mesh=mesh, keep=keys, features=features)
        self.cfg, self.mesh = cfg, mesh
        self._residuals = _Residuals()
        spec = sharding.logical_to_spec(ACT_BTD, sharding.RULE_TABLES[cfg.parallel.rules], mesh,
                                        (self.prog.rows, cfg.train.seq_len, cfg.model.d_model))
        self.activation = NamedSharding(mesh, spec)
        self.rows = NamedSharding(mesh, sharding.batch_spec(mesh))  # [rows, T] token-shaped inputs
        self.grad_shardings = sharding.named(mesh, self.prog.grad_specs)
        self.experts = expert_count(cfg.model)  # a mixture of experts: its router statistics travel with h
        self.stats = NamedSharding(mesh, P())
        self._run = stage_fn(self.prog, first=self.first, last=self.last, router_carry=bool(self.experts))
        self.forward = jax.jit(self._forward)
        self.backward = jax.jit(self._backward, donate_argnums=(3,),  # residuals free as the driver drops them
                                out_shardings=(self.grad_shardings, None if self.first else self._carried()))
        self.zero_grads = jax.jit(self._zero_grads, out_shardings=self.grad_shardings)
        self.grad_sums = jax.jit(self._grad_sums)
        self.params_for_grad = jax.jit(self._params_for_grad)
        # explicit state shardings: they carry the host memory kinds of offloaded state (also deviceless)
        self.update = jax.jit(self._update, in_shardings=(self.prog.state_shardings, self.grad_shardings, None),
                              out_shardings=self.prog.state_shardings, donate_argnums=(0,),
                              keep_unused=True)  # old params (unread with a master copy) alias the new
        self.evaluate = jax.jit(self._evaluate)

    # ------------------------------------------------------------ what the driver runs
    def _params_for_grad(self, params):
        return offload.cast_for_grad(self.cfg, params, self.prog.precision.grad_reduce)

    def _zero_grads(self):
        return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), self.prog.layout.abstract_params)

    def _carried(self):
        """What goes between stages: the hidden states' sharding (and the statistics' for a mixture)."""
        return (self.activation, self.stats) if self.experts else self.activation

    def _constrain(self, x):
        return jax.lax.with_sharding_constraint(x, self._carried())

    def _call(self, params, x, extras):
        """(what the vjp differentiates: hidden states or the loss; what the driver reports on the last stage:
        the loss sum, and for a mixture (loss sum, router losses))."""
        labels, segment_ids, positions = extras
        if self.experts and not self.first:
            h, packed = x
            x = (h, unpack_stats(packed, self.experts))
        if self.last and self.experts:
            m = self.cfg.model
            (loss_sum, n_micro), router = self._run(params, x, labels, segment_ids, positions, router_losses=True)
            extra = m.router_aux_loss_coef * router["moe_aux_loss"] + m.router_z_loss_coef * router["moe_z_loss"]
            return loss_sum + n_micro.astype(jnp.float32) * extra, (loss_sum, router)
        out = self._run(params, x, labels, segment_ids, positions)
        if self.last:
            return out[0], out[0]  # the loss sum (its count is the driver's)
        if self.experts:
            out = (out[0], pack_stats(out[1]))
        return out, None

    def _forward(self, params, x, extras):
        """(hidden states for the next stage, or this micro-batch's loss sum on the last; residuals)."""
        if self.first:  # integer tokens get no cotangent
            out, pullback, report = jax.vjp(lambda p: self._call(p, x, extras), params, has_aux=True)
        else:
            out, pullback, report = jax.vjp(lambda p, h: self._call(p, h, extras), params, x, has_aux=True)
        leaves, treedef = jax.tree.flatten(pullback)
        param_leaves = jax.tree.leaves(params)
        sources = tuple(next((i for i, p in enumerate(param_leaves) if p is leaf), None) for leaf in leaves)
        self._residuals = _Residuals(treedef, sources)
        out = report if self.last else self._constrain(out)
        return out, [leaf for leaf, src in zip(leaves, sources) if src is None]

    def _backward(self, params, residuals, cotangent, grads):
        """(grads + this micro-batch's, in fp32; the cotangent of the stage's input, None on the first)."""
        param_leaves, kept = jax.tree.leaves(params), iter(residuals)
        leaves = [param_leaves[s] if s is not None else next(kept) for s in self._residuals.sources]
        pulled = jax.tree.unflatten(self._residuals.treedef, leaves)(cotangent)
        g, dx = (pulled[0], None) if self.first else pulled
        g = offload.constrain_device_part(self.cfg, g, self.grad_shardings)
        grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
        if dx is not None:
            dx = self._constrain(dx)
        return grads, dx

    def _evaluate(self, params, x, extras):
        """Forward only (held-out evaluation): hidden states, or (loss sum, valid labels) on the last stage."""
        if self.experts and not self.first:
            x = (x[0], unpack_stats(x[1], self.experts))
        out = self._run(self._params_for_grad(params), x, *extras)
        if self.last:
            return out[0], out[1].astype(jnp.float32)
        return self._constrain((out[0], pack_stats(out[1])) if self.experts else out)

    def _grad_sums(self, grads):
        """Sum of squares of this stage's gradients (the global norm is over every stage)."""
        leaves = jax.tree.leaves(grads)
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)

    def _update(self, state, grads, norm):
        prec, cfg = self.prog.precision, self.cfg
        state = offload.mark_host_entries(cfg, state)
        weights = state["master"] if "master" in state else state["params"]
        # the stage's index folded in: each stage's layers round with bits of their own
        key = rounding_key(self.prog, state["step"])
        common = dict(clip_norm=cfg.optimizer.clip_norm, param_dtype=prec.param, skip_nonfinite=False, norm=norm,
                      round_key=None if key is None else jax.random.fold_in(key, self.index))
        if self.prog.layout.homes.update_on_host:  # whole tensors, as the one-program step (core.program)
            update = functools.partial(whole_update, self.prog.optimizer, fused=self.prog.fused_update, **common)
        else:
            update = functools.partial(layerwise_update, self.prog.optimizer, **common)
        new_params, new_opt, new_weights, _ = offload.run_update(cfg, update, grads, state["opt"], weights, None,
                                                                 jnp.float32(1.0))
        new_params = offload.constrain_device_part(cfg, new_params, self.prog.state_shardings["params"])
        new_state = dict(state, step=state["step"] + 1, params=new_params, opt=new_opt)
        if "master" in state:
            new_state["master"] = new_weights
        return new_state

    # ------------------------------------------------------------ abstract values (plans, compiles)
    def abstract_extras(self):
        """(labels, segment ids, positions) of one micro-batch as this stage takes them (None where unused)."""
        rows = jax.ShapeDtypeStruct((self.prog.rows, self.cfg.train.seq_len), jnp.int32, sharding=self.rows)
        packed = "segment_ids" in self.prog.batch_keys
        return (rows if self.last else None, rows if packed else None, rows if packed else None)

    def abstract_input(self):
        if self.first:
            return jax.ShapeDtypeStruct((self.prog.rows, self.cfg.train.seq_len), jnp.int32, sharding=self.rows)
        h = jax.ShapeDtypeStruct(self.activation_shape, self.prog.precision.compute, sharding=self.activation)
        if self.experts:
            return h, jax.ShapeDtypeStruct((stats_size(self.experts),), jnp.float32, sharding=self.stats)
        return h

    def abstract_cotangent(self, out_aval, out_sharding):
        """The backward's cotangent for the forward's first output: the loss's scalar on the last stage, else
        what the forward hands on (hidden states, and a mixture's statistics)."""
        if self.last:
            return jax.ShapeDtypeStruct((), jnp.float32, sharding=self.stats)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out_aval, out_sharding)

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        return (self.prog.rows, self.cfg.train.seq_len, self.cfg.model.d_model)

    def abstract_params_for_grad(self):
        return jax.eval_shape(self._params_for_grad, self.prog.abstract_state["params"])


_SCALAR_STATS = ("router_z", "rows", "dropped")  # after the per-expert rows and probabilities


def stats_size(experts: int) -> int:
    """Length of a mixture's packed router statistics: per-expert rows and probabilities, then the scalars
    (z, rows, dropped assignments)."""
    return 2 * experts + len(_SCALAR_STATS)


def pack_stats(stats: dict) -> jax.Array:
    """The router statistics (jaxmem.model.moe.zero_stats' keys) as one fp32 vector, to cross a stage boundary."""
    return jnp.concatenate([stats["expert_rows"], stats["router_prob"]] + [stats[k][None] for k in _SCALAR_STATS])


def unpack_stats(packed: jax.Array, experts: int) -> dict:
    e = experts
    scalars = {k: packed[2 * e + i] for i, k in enumerate(_SCALAR_STATS)}
    return {"expert_rows": packed[:e], "router_prob": packed[e:2 * e], **scalars}
