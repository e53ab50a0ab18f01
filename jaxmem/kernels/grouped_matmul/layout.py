"""Where each row of a grouped matmul goes when every group is padded to whole blocks.

Rows arrive sorted by group (group g is a run of group_sizes[g] rows). Padding each group up to a multiple of
`block` rows makes every block belong to one group, so a block is one plain [block, D] x [D, F] product. The
padded row count is static: sum_g ceil(n_g / b) <= ceil(M / b) + G - 1 blocks (each group adds at most one
partial block), rounded up here to whole chunks of blocks.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def padded_blocks(rows: int, groups: int, block: int) -> int:
    """The most blocks any split of `rows` rows into `groups` groups can need (static)."""
    return max(1, min(-(-rows // block) + groups - 1, rows))


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    gather_p: jax.Array  # [P] source row of each padded row; `rows` (out of range: a zero row) for padding
    scatter_m: jax.Array  # [M] padded position of each row; P (out of range: zero) for rows after the groups
    block_group: jax.Array  # [P / block] the group of each block (clamped to the last group past the used ones)
    used_blocks: jax.Array  # scalar int32: blocks holding at least one row; the rest are all padding


def block_layout(group_sizes, rows: int, block: int, n_blocks: int) -> BlockLayout:
    """Index maps between M sorted rows and n_blocks x block padded rows (all int32, O(M + P) work)."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    blocks_per_group = (sizes + block - 1) // block
    block_end = jnp.cumsum(blocks_per_group)
    block_start = block_end - blocks_per_group
    row_end = jnp.cumsum(sizes)
    row_start = row_end - sizes

    block_ids = jnp.arange(n_blocks, dtype=jnp.int32)
    block_group = jnp.minimum(jnp.searchsorted(block_end, block_ids, side="right"), groups - 1).astype(jnp.int32)
    p = jnp.arange(n_blocks * block, dtype=jnp.int32)
    g_p = block_group[p // block]
    offset = p - block_start[g_p] * block
    used_blocks = block_end[-1]
    valid = (p // block < used_blocks) & (offset < sizes[g_p])
    gather_p = jnp.where(valid, row_start[g_p] + offset, rows)

    m = jnp.arange(rows, dtype=jnp.int32)
    g_m = jnp.searchsorted(row_end, m, side="right").astype(jnp.int32)
    g_safe = jnp.minimum(g_m, groups - 1)
    scatter_m = jnp.where(g_m < groups, block_start[g_safe] * block + (m - row_start[g_safe]), n_blocks * block)
    return BlockLayout(gather_p, scatter_m, block_group, used_blocks.astype(jnp.int32))


def take_rows(x, index):
    """x[index] along rows, zero where index is out of range (padding)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)
