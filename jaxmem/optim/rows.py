"""An embedding table's gradient as the rows a step touched (`RowGrad`), and the tree helpers the optimizer
update reads it through. jaxmem.core.embed_grad makes these gradients (from the step's tokens) and decides
where they apply; the update only sums, scales and widens them."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids", "sums"], meta_fields=["vocab"])
@dataclasses.dataclass(frozen=True)
class RowGrad:
    """Gradient of a [vocab, d] table: `sums[i]` is the summed gradient of row `ids[i]`; unused slots have the
    id `vocab` (out of range) and zero sums."""
    ids: jax.Array  # [n] int32, distinct
    sums: jax.Array  # [n, d] fp32
    vocab: int


def is_rows(x) -> bool:
    return isinstance(x, RowGrad)


def dense(g: RowGrad, sharding=None) -> jax.Array:
    """The [vocab, d] table the rows stand for, in the sums' memory space (the host, inside an update there)."""
    zeros = jnp.zeros((g.vocab, g.sums.shape[-1]), g.sums.dtype)
    space = jax.typeof(g.sums).memory_space
    if jax.typeof(zeros).memory_space != space:
        zeros = jax.device_put(zeros, space)
    if sharding is not None:
        zeros = jax.lax.with_sharding_constraint(zeros, sharding)
    return zeros.at[g.ids].add(g.sums, mode="drop")


def map_values(fn, tree):
    """fn over the values of a gradient tree: a RowGrad's sums, every other leaf."""
    return jax.tree.map(lambda x: dataclasses.replace(x, sums=fn(x.sums)) if is_rows(x) else fn(x), tree,
                        is_leaf=is_rows)


def densify(tree):
    return jax.tree.map(lambda x: dense(x) if is_rows(x) else x, tree, is_leaf=is_rows)
