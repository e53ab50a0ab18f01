"""Grouped matmul in plain XLA that never densifies: groups padded to whole blocks, a loop over chunks of blocks.

Each group's rows are padded to a multiple of `block_rows` (jaxmem.kernels.grouped_matmul.layout), so every
block belongs to one group. A loop over chunks of blocks gathers the chunk's group weights ([c, D, F], about
CHUNK_WEIGHT_BYTES) and does one batched dot; the loop stops after the last block that holds a row, so the
FLOPs are those of the padded rows (about the active rows), not G times them as XLA:GPU's ragged_dot. The
backward (custom_vjp) walks the same chunks: d_lhs with the weights transposed, d_rhs as per-block x^T dy added
into an fp32 [G, D, F] accumulator one block at a time (deterministic), cast back at the end. Temporaries:
O(padded rows x (D + F)) plus one chunk of weights, plus the fp32 accumulator in the backward.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.kernels.grouped_matmul.config import GroupedMatmulBlocks
from jaxmem.runtime import compat
from jaxmem.kernels.grouped_matmul.layout import block_layout, padded_blocks, take_rows

MAX_CHUNK_BLOCKS = 16  # the backward unrolls one accumulator update per block of a chunk


def _plan(lhs, rhs, group_sizes, blocks: GroupedMatmulBlocks):
    """(block rows, blocks per chunk, chunks, layout) for these shapes."""
    rows, groups = lhs.shape[0], rhs.shape[0]
    block = max(1, min(blocks.block_rows, rows))
    n_blocks = padded_blocks(rows, groups, block)
    per_group = rhs.shape[1] * rhs.shape[2] * rhs.dtype.itemsize
    chunk = min(blocks.chunk(n_blocks, per_group), MAX_CHUNK_BLOCKS)
    n_chunks = -(-n_blocks // chunk)
    return block, chunk, n_chunks, block_layout(group_sizes, rows, block, n_chunks * chunk)


def _forward(lhs, rhs, group_sizes, out_dtype, blocks):
    d, f = rhs.shape[1:]
    block, chunk, n_chunks, layout = _plan(lhs, rhs, group_sizes, blocks)
    x = take_rows(lhs, layout.gather_p).reshape(n_chunks, chunk, block, d)
    chunk_groups = layout.block_group.reshape(n_chunks, chunk)

    def step(i, y):
        w = jnp.take(rhs, chunk_groups[i], axis=0)
        y_chunk = jnp.einsum("cbd,cdf->cbf", x[i], w, preferred_element_type=jnp.float32).astype(out_dtype)
        return jax.lax.dynamic_update_index_in_dim(y, y_chunk, i, 0)

    used_chunks = (layout.used_blocks + chunk - 1) // chunk
    # the carry varies like the inputs inside a shard_map (jaxmem.moe.expert_parallel)
    y0, *_ = compat.match_varying(jnp.zeros((n_chunks, chunk, block, f), out_dtype), lhs)
    y = jax.lax.fori_loop(0, used_chunks, step, y0)
    return take_rows(y.reshape(-1, f), layout.scatter_m)


def _backward(lhs, rhs, group_sizes, dy, blocks):
    groups, d, f = rhs.shape
    block, chunk, n_chunks, layout = _plan(lhs, rhs, group_sizes, blocks)
    x = take_rows(lhs, layout.gather_p).reshape(n_chunks, chunk, block, d)
    dy_p = take_rows(dy, layout.gather_p).reshape(n_chunks, chunk, block, f)
    chunk_groups = layout.block_group.reshape(n_chunks, chunk)

    def step(i, carry):
        dx, dw = carry
        group = chunk_groups[i]
        w = jnp.take(rhs, group, axis=0)
        dx_chunk = jnp.einsum("cbf,cdf->cbd", dy_p[i], w, preferred_element_type=jnp.float32).astype(lhs.dtype)
        dx = jax.lax.dynamic_update_index_in_dim(dx, dx_chunk, i, 0)
        dw_blocks = jnp.einsum("cbd,cbf->cdf", x[i], dy_p[i], preferred_element_type=jnp.float32)
        for j in range(chunk):  # in block order: the same sums on every run
            row = jax.lax.dynamic_index_in_dim(dw, group[j], 0, keepdims=False)
            dw = jax.lax.dynamic_update_index_in_dim(dw, row + dw_blocks[j], group[j], 0)
        return dx, dw

    used_chunks = (layout.used_blocks + chunk - 1) // chunk
    init = (jnp.zeros((n_chunks, chunk, block, d), lhs.dtype), jnp.zeros((groups, d, f), jnp.float32))
    init = compat.match_varying(*init, lhs, dy)[:2]
    dx, dw = jax.lax.fori_loop(0, used_chunks, step, init)
    return take_rows(dx.reshape(-1, d), layout.scatter_m), dw.astype(rhs.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_matmul(lhs, rhs, group_sizes, out_dtype, blocks):
    return _forward(lhs, rhs, group_sizes, out_dtype, blocks)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, out_dtype, blocks):
    return _forward(lhs, rhs, group_sizes, out_dtype, blocks), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(out_dtype, blocks, residuals, dy):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = _backward(lhs, rhs, group_sizes, dy, blocks)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None,
                   blocks: GroupedMatmulBlocks = GroupedMatmulBlocks()):
    """lhs [M, D] (rows sorted by group), rhs [G, D, F], group_sizes [G] int -> [M, F], as jax.lax.ragged_dot.

    The output has preferred_element_type (default: the inputs' result type); products accumulate in fp32.
    """
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    return _grouped_matmul(*compat.match_varying(lhs, rhs, group_sizes), out_dtype, blocks)
