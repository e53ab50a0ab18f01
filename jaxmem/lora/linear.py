"""A LoRA run's projections: y = x W + scale * (x A) B, the frozen W never merged, never differentiated.

The layer scan (jaxmem.lora.frozen.fetch_fn) hands the model each frozen linear of a layer as a
`FrozenWeight` (its stored slice: bf16, or int8 / nf4 leaves) or, where it carries adapters, an
`AdaptedWeight` (the FrozenWeight, the layer's A [*in, r] and B [r, *out], a dropout key or None), and the
model's projection hook (`ForwardContext.project`) is `project` below.

The base matmul runs under a checkpoint that saves nothing (`frozen_einsum`): its forward dequantizes W in
the compute dtype, its only residual is its input, the stored form (a slice of the base the layer scan
holds anyway, so the scan forwards it instead of stacking a copy), and its backward dequantizes W again for
dx = dy W^T. W is under stop_gradient, so no weight-shaped gradient is ever formed. So no dequantized
weight lives from the forward to the backward, with or without a remat policy (`remat.preset=none`
included). The low-rank path is ordinary autodiff in the compute dtype with fp32
accumulation: its residuals are the projection's input (kept anyway) and x A ([tokens, r]); its backward
adds scale * (dy B^T) A^T to dx and gives dA = x^T (scale * dy B^T), dB = (x A)^T (scale * dy).

A mixture of experts' grouped matmuls (`ForwardContext.grouped`, `grouped_project` here) take the same two
paths over the rows sorted by expert: x W_e by a ragged_dot with W [E, *in, *out] dequantized under the
save-nothing checkpoint, and the adapters (rows A_e) B_e as two more ragged_dots with A [E, D, r], B [E, r, F].
"""
from __future__ import annotations

import dataclasses
import functools
import string

import jax
import jax.numpy as jnp

from jaxmem.core.quant import dequantize
from jaxmem.model.layers import einsum_project
from jaxmem.model.moe import grouped_linear


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FrozenWeight:
    """One layer's frozen linear in its stored form (the model reads it as `w[...]`)."""

    stored: object  # an array (bf16 base) or a dict of int8 / nf4 leaves, this layer's slice
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # the weight's [*in, *out]
    base_dtype: str = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, index):
        return self

    def dequantize(self, dtype) -> jax.Array:
        return dequantize(self.base_dtype, self.stored, self.shape, dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdaptedWeight:
    """One layer's adapted linear: the frozen weight and its adapters (the model reads it as `w[...]`)."""

    base: FrozenWeight
    a: jax.Array  # [*in, r]
    b: jax.Array  # [r, *out]
    key: jax.Array | None  # the dropout key of this layer and projection (train step only), else None
    scale: float = dataclasses.field(metadata=dict(static=True))
    p: float = dataclasses.field(metadata=dict(static=True))  # dropout probability on the adapters' input

    def __getitem__(self, index):
        return self

    @property
    def shape(self) -> tuple:
        """The frozen weight's shape (a mixture of experts reads its expert count from it)."""
        return self.base.shape


def frozen_einsum(spec: str, x: jax.Array, w: FrozenWeight, compute_dtype) -> jax.Array:
    """einsum(spec, x, W) with W dequantized from `w` in the compute dtype (x is in the compute dtype), under a
    checkpoint that saves nothing: the backward's dx = dy W^T dequantizes W again from the stored form."""
    return _frozen_einsum(spec, compute_dtype, x, w)


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=(0, 1))
def _frozen_einsum(spec, compute_dtype, x, w):
    w = jax.tree.map(jax.lax.stop_gradient, w)  # frozen: no tangent reaches W, so no dW is ever formed
    return jnp.einsum(spec, x, w.dequantize(compute_dtype))


def drop(key: jax.Array, x: jax.Array, p: float) -> jax.Array:
    """Inverted dropout: each element kept with probability 1 - p and scaled by 1 / (1 - p), in x's dtype."""
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - p, x.dtype), jnp.zeros((), x.dtype))


def low_rank(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, compute_dtype) -> jax.Array:
    """(x A) B in fp32 for the projection `spec`: both matmuls take compute-dtype inputs, accumulate in fp32."""
    ins, rest = spec.split(",")
    w_letters, out = rest.split("->")
    n_in = a.ndim - 1
    r = next(c for c in string.ascii_letters if c not in spec)
    xa = jnp.einsum(f"{ins},{w_letters[:n_in]}{r}->{ins[:-n_in]}{r}", x, a.astype(compute_dtype),
                    preferred_element_type=jnp.float32)
    return jnp.einsum(f"{ins[:-n_in]}{r},{r}{w_letters[n_in:]}->{out}", xa.astype(compute_dtype),
                      b.astype(compute_dtype), preferred_element_type=jnp.float32)


def project(spec: str, x: jax.Array, w, compute_dtype) -> jax.Array:
    """The projection hook of a LoRA run: a FrozenWeight as x W (custom VJP), an AdaptedWeight as
    x W + scale * (drop(x) A) B (the sum in fp32, cast to the compute dtype), a plain weight as the model's
    default einsum."""
    if isinstance(w, FrozenWeight):
        return frozen_einsum(spec, x.astype(compute_dtype), w, compute_dtype)
    if not isinstance(w, AdaptedWeight):
        return einsum_project(spec, x, w, compute_dtype)
    x = x.astype(compute_dtype)
    y = frozen_einsum(spec, x, w.base, compute_dtype)
    x_in = drop(w.key, x, w.p) if w.key is not None and w.p > 0 else x
    low = low_rank(spec, x_in, w.a, w.b, compute_dtype)
    return (y.astype(jnp.float32) + w.scale * low).astype(compute_dtype)


def frozen_ragged(x_rows: jax.Array, w: FrozenWeight, group_sizes: jax.Array, compute_dtype,
                  kernel=jax.lax.ragged_dot) -> jax.Array:
    """The grouped matmul `kernel` (jaxmem.kernels.grouped_matmul) of x by W over rows grouped by expert, W
    [E, *in, *out] dequantized from `w` under the save-nothing checkpoint of frozen_einsum."""
    return _frozen_ragged(compute_dtype, kernel, x_rows, w, group_sizes)


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=(0, 1))
def _frozen_ragged(compute_dtype, kernel, x, w, group_sizes):
    w = jax.tree.map(jax.lax.stop_gradient, w)
    return kernel(x, w.dequantize(compute_dtype), group_sizes, preferred_element_type=compute_dtype)


def grouped_project(x_rows: jax.Array, w, group_sizes: jax.Array, compute_dtype, *,
                    kernel=jax.lax.ragged_dot) -> jax.Array:
    """The grouped-matmul hook of a LoRA run (rows sorted by expert, group_sizes rows per expert): a
    FrozenWeight as x W_e, an AdaptedWeight as x W_e + scale * (drop(x) A_e) B_e (fp32 sum, compute dtype out),
    a plain weight as the model's default; every product through the grouped matmul `kernel`."""
    if isinstance(w, FrozenWeight):
        return frozen_ragged(x_rows.astype(compute_dtype), w, group_sizes, compute_dtype, kernel)
    if not isinstance(w, AdaptedWeight):
        return grouped_linear(x_rows, w, group_sizes, compute_dtype, kernel=kernel)
    x = x_rows.astype(compute_dtype)
    y = frozen_ragged(x, w.base, group_sizes, compute_dtype, kernel)
    x_in = drop(w.key, x, w.p) if w.key is not None and w.p > 0 else x
    xa = kernel(x_in, w.a.astype(compute_dtype), group_sizes, preferred_element_type=jnp.float32)
    low = kernel(xa.astype(compute_dtype), w.b.astype(compute_dtype), group_sizes, preferred_element_type=jnp.float32)
    return (y.astype(jnp.float32) + w.scale * low).astype(compute_dtype)
