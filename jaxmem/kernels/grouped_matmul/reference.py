"""The executable spec of the grouped matmul: jax.lax.ragged_dot, and an explicit per-group loop for tests.

out[m] = lhs[m] @ rhs[g] for the rows m of group g; the groups are consecutive runs of rows, group g holding
group_sizes[g] of them; rows after the last group are zero.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def grouped_matmul_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
    """jax.lax.ragged_dot (lhs [M, D], rhs [G, D, F], group_sizes [G]) -> [M, F]. XLA:GPU lowers it densely
    (a masked [M, G x D] lhs, G times the FLOPs), so this is the spec and the CPU default, not the GPU path."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)


def grouped_matmul_loop(lhs, rhs, group_sizes) -> np.ndarray:
    """The same product in float64 numpy, one group at a time (concrete group sizes only)."""
    lhs, rhs = np.asarray(jnp.asarray(lhs, jnp.float32), np.float64), np.asarray(jnp.asarray(rhs, jnp.float32),
                                                                                   np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[-1]))
    start = 0
    for g, size in enumerate(np.asarray(group_sizes)):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out
