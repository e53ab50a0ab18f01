"""Stochastic rounding of fp32 to bf16, keyed by (seed, step) so a resumed run draws the same bits.

bf16 is fp32's upper 16 bits. Adding a uniform random 16-bit integer to the lower 16 bits, then dropping them,
rounds the magnitude up with probability (dropped part) / 2**16 and down otherwise: unbiased in expectation,
so updates smaller than half a bf16 ulp still move a bf16 weight on average instead of vanishing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def step_key(seed: int, step) -> jax.Array:
    """The rounding key of optimizer step `step` (an int or a traced int32) of a run seeded `seed`."""
    return jax.random.fold_in(jax.random.key(seed), step)


def to_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """x (fp32) stochastically rounded to bf16; NaN stays NaN, inf stays inf."""
    x = x.astype(jnp.float32)
    noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
    space = jax.typeof(x).memory_space  # the host, in an update under host compute
    if jax.typeof(noise).memory_space != space:
        noise = jax.device_put(noise, space)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isfinite(x), rounded, x).astype(jnp.bfloat16)


def tree_to_bf16(tree, key: jax.Array):
    """Every leaf of `tree` stochastically rounded to bf16, leaf i with key fold_in(key, i)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([to_bf16(x, jax.random.fold_in(key, i)) for i, x in enumerate(leaves)])
