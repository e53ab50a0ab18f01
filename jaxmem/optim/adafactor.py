"""Adafactor (optax.adafactor: factored second moment, no first moment) in make_optimizer's shape.

optax factors a tensor's second moment over its two largest dims, and only where the second largest is at least
128 long. Our attention weights keep heads and head_dim apart ([d, heads, head_dim] per layer), so with a
head_dim under 128 optax found d and head_dim, gave up, and kept the whole tensor's second moment in fp32. The
statistics are therefore taken on each weight viewed as the matrix it is used as: its input dims merged into
one, its output dims into another, the dims before them (a layer stack, experts) kept as batch dims.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.schema import Config
from jaxmem.optim.hyper import decay_mask, schedule

# How many of a weight's trailing dims are its inputs and its outputs where that is not one and one (our einsum
# layout, jaxmem.model.layers): q/k/v are [d] -> [heads, head_dim], the output projection [heads, head_dim] -> [d].
MATRIX_DIMS = {"wq": (1, 2), "wk": (1, 2), "wv": (1, 2), "wo": (2, 1)}
# A LoRA adapter of one of them (jaxmem.lora.adapters): A is [*in, rank], B is [rank, *out].
ADAPTER_DIMS = {"a": lambda dims: (dims[0], 1), "b": lambda dims: (1, dims[1])}


def make_adafactor(cfg: Config, *, decay_rate: float = 0.8, clipping_threshold: float | None = 1.0,
                   momentum: float | None = None) -> optax.GradientTransformation:
    """optax.adafactor on `cfg.optimizer`'s schedule with its decoupled weight decay (norms and biases not
    decayed), its statistics taken on each weight's matrix view (`matrix_shape`). `optimizer.lr` keeps AdamW's
    absolute meaning: the update is not multiplied by the parameter's RMS (optax's multiply_by_parameter_scale
    is off), and the decay is lr(t) * weight_decay * w like AdamW's, where optax.adafactor adds its rate
    unscaled by the learning rate. b1, b2 and eps are Adam's and unused."""
    o = cfg.optimizer
    lr = schedule(cfg)
    decay = (lambda step: lr(step) * o.weight_decay) if o.weight_decay else None
    inner = optax.adafactor(learning_rate=lr, decay_rate=decay_rate, clipping_threshold=clipping_threshold,
                            multiply_by_parameter_scale=False, momentum=momentum, weight_decay_rate=decay,
                            weight_decay_mask=decay_mask)
    return _on_matrix_views(_state_in_fp32(inner))


def matrix_shape(path, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a weight's statistics are taken on: [*batch, inputs, outputs] for the attention projections
    (and their LoRA adapters), whose inputs or outputs span two dims; every other shape as it is."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    dims = MATRIX_DIMS.get(names[-1]) if names else None
    if dims is None and len(names) >= 2 and names[-1] in ADAPTER_DIMS and names[-2] in MATRIX_DIMS:
        dims = ADAPTER_DIMS[names[-1]](MATRIX_DIMS[names[-2]])
    if dims is None or len(shape) < sum(dims):
        return tuple(shape)
    n_in, n_out = dims
    batch = len(shape) - n_in - n_out
    inputs, outputs = shape[batch:batch + n_in], shape[batch + n_in:]
    return tuple(shape[:batch]) + (math.prod(inputs), math.prod(outputs))


def _as_matrices(tree):
    return jax.tree_util.tree_map_with_path(lambda path, x: x.reshape(matrix_shape(path, x.shape)), tree)


def _on_matrix_views(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner` run on the matrix views of the params and updates (a reshape: the same values, the same tree and
    leaf names, so the decay mask holds); its updates come back in the params' shapes."""
    def init(params):
        return inner.init(_as_matrices(params))

    def update(updates, state, params=None):
        views = None if params is None else _as_matrices(params)
        new_updates, new_state = inner.update(_as_matrices(updates), state, views)
        return jax.tree.map(lambda u, g: u.reshape(g.shape), new_updates, updates), new_state

    return optax.GradientTransformation(init, update)


def _state_in_fp32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax.adafactor keeps its statistics in the params' dtype: bf16 params without a master would get bf16
    factors (and a first update that widens them to fp32). Initialized from fp32 stand-ins they are fp32."""
    def init(params):
        return inner.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))

    return optax.GradientTransformation(init, inner.update)
