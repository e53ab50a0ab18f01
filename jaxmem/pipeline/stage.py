"""One pipeline stage: a train program of its own (its layers, its end params, its mesh) and the four
functions the schedule runs on it: forward, backward, gradient norm and update.

The forward returns the pass's residuals (what the backward needs, as the remat policy leaves them) to the
driver, which holds them until the micro-batch's backward: so a stage's memory is its state plus the
residuals of the micro-batches in flight (1F1B: at most pp - s), and a stage with fewer layers holds less.
Residuals that are just the stage's params are not returned (they would be copies): the backward takes
the params again and puts them back in place.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxmem.core import offload, sharding
from jaxmem.model.layers import ACT_BTD
from jaxmem.core.optim import layerwise_update
from jaxmem.core.program import TrainProgram, build_program, stage_fn
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
    def __init__(self, cfg: Config, index: int, n_layers: int, keys: tuple[str, ...], mesh):
        self.index, self.n_layers, self.keys = index, n_layers, keys
        self.first, self.last = index == 0, index == cfg.parallel.pp - 1
        self.prog: TrainProgram = build_program(stage_config(cfg, n_layers), mesh=mesh, keep=keys)
        self.cfg, self.mesh = cfg, mesh
        self._residuals = _Residuals()
        spec = sharding.logical_to_spec(ACT_BTD, sharding.RULE_TABLES[cfg.parallel.rules], mesh,
                                        (self.prog.rows, cfg.train.seq_len, cfg.model.d_model))
        self.activation = NamedSharding(mesh, spec)
        self.rows = NamedSharding(mesh, sharding.batch_spec(mesh))  # [rows, T] token-shaped inputs
        self.grad_shardings = sharding.named(mesh, self.prog.grad_specs)
        self._run = stage_fn(self.prog, first=self.first, last=self.last)
        self.forward = jax.jit(self._forward)
        self.backward = jax.jit(self._backward, donate_argnums=(3,),  # residuals free as the driver drops them
                                out_shardings=(self.grad_shardings, None if self.first else self.activation))
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

    def _call(self, params, x, extras):
        labels, segment_ids, positions = extras
        out = self._run(params, x, labels, segment_ids, positions)
        return out[0] if self.last else out  # the loss sum (its count is the driver's)

    def _forward(self, params, x, extras):
        """(hidden states for the next stage, or this micro-batch's loss sum on the last; residuals)."""
        if self.first:  # integer tokens get no cotangent
            out, pullback = jax.vjp(lambda p: self._call(p, x, extras), params)
        else:
            out, pullback = jax.vjp(lambda p, h: self._call(p, h, extras), params, x)
        leaves, treedef = jax.tree.flatten(pullback)
        param_leaves = jax.tree.leaves(params)
        sources = tuple(next((i for i, p in enumerate(param_leaves) if p is leaf), None) for leaf in leaves)
        self._residuals = _Residuals(treedef, sources)
        if not self.last:
            out = jax.lax.with_sharding_constraint(out, self.activation)
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
            dx = jax.lax.with_sharding_constraint(dx, self.activation)
        return grads, dx

    def _evaluate(self, params, x, extras):
        """Forward only (held-out evaluation): hidden states, or (loss sum, valid labels) on the last stage."""
        out = self._run(self._params_for_grad(params), x, *extras)
        if self.last:
            return out[0], out[1].astype(jnp.float32)
        return jax.lax.with_sharding_constraint(out, self.activation)

    def _grad_sums(self, grads):
        """Sum of squares of this stage's gradients (the global norm is over every stage)."""
        leaves = jax.tree.leaves(grads)
        return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)

    def _update(self, state, grads, norm):
        prec, cfg = self.prog.precision, self.cfg
        state = offload.mark_host_entries(cfg, state)
        weights = state["master"] if "master" in state else state["params"]
        update = functools.partial(layerwise_update, self.prog.optimizer, clip_norm=cfg.optimizer.clip_norm,
                                   param_dtype=prec.param, skip_nonfinite=False, norm=norm)
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
        return jax.ShapeDtypeStruct(self.activation_shape, self.prog.precision.compute, sharding=self.activation)

    @property
    def activation_shape(self) -> tuple[int, int, int]:
        return (self.prog.rows, self.cfg.train.seq_len, self.cfg.model.d_model)

    def abstract_params_for_grad(self):
        return jax.eval_shape(self._params_for_grad, self.prog.abstract_state["params"])
