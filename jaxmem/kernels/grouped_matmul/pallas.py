"""Grouped matmul in Pallas (Triton backend) over the padded block layout: no weight gather, no fp32 [G, D, F].

Rows are padded per group to whole blocks of `block_rows` (jaxmem.kernels.grouped_matmul.layout), so a program
multiplies one block by its group's weights, read in place. Forward and d_lhs: one kernel, grid (blocks, output
column tiles), a loop over the contraction in `pallas_block_k` steps; d_lhs reads the weight tiles transposed.
Blocks after the last used one are skipped (their rows are never read back). d_rhs: grid (groups, D tiles,
F tiles); each program sums x^T dy over its group's blocks in fp32 and writes its tile once in the weights'
dtype (an empty group writes zeros), so nothing is accumulated across programs and no atomics are needed.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmem.config.targets import TARGETS
from jaxmem.runtime import compat
from jaxmem.kernels.grouped_matmul.config import GroupedMatmulBlocks
from jaxmem.kernels.grouped_matmul.layout import block_layout, padded_blocks, take_rows


def _load(ref, rows, cols, mask, dtype):
    """A masked tile of `ref` as `dtype`: a dot's two sides share one element type in Triton, and a backward
    may pair an fp32 output gradient (preferred_element_type=float32) with bf16 rows or weights."""
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0).astype(dtype)


def _matmul_kernel(group_ref, used_ref, x_ref, w_ref, y_ref, *, bm, bk, bn, k_dim, n_dim, transpose):
    i, j = pl.program_id(0), pl.program_id(1)

    @pl.when(i < used_ref[0])
    def _():
        g = group_ref[i]
        rows = i * bm + jnp.arange(bm)
        cols = j * bn + jnp.arange(bn)

        dtype = jnp.promote_types(x_ref.dtype, w_ref.dtype)

        def step(k, acc):
            ks = k * bk + jnp.arange(bk)
            x = _load(x_ref, rows, ks, jnp.broadcast_to((ks < k_dim)[None, :], (bm, bk)), dtype)
            if transpose:  # w_ref is [G * N, K]: the tile of w[g]^T
                w = _load(w_ref, g * n_dim + cols, ks, (cols < n_dim)[:, None] & (ks < k_dim)[None, :], dtype)
                return acc + plgpu.dot(x, w, trans_b=True)
            w = _load(w_ref, g * k_dim + ks, cols, (ks < k_dim)[:, None] & (cols < n_dim)[None, :], dtype)
            return acc + plgpu.dot(x, w)

        acc = jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), step, jnp.zeros((bm, bn), jnp.float32))
        mask = jnp.broadcast_to((cols < n_dim)[None, :], (bm, bn))
        plgpu.store(y_ref.at[rows[:, None], cols[None, :]], acc.astype(y_ref.dtype), mask=mask)


def _dw_kernel(start_ref, count_ref, x_ref, dy_ref, dw_ref, *, bm, bd, bf, d, f):
    g, a, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    d_cols = a * bd + jnp.arange(bd)
    f_cols = c * bf + jnp.arange(bf)

    dtype = jnp.promote_types(x_ref.dtype, dy_ref.dtype)

    def step(block, acc):
        rows = block * bm + jnp.arange(bm)
        x = _load(x_ref, rows, d_cols, jnp.broadcast_to((d_cols < d)[None, :], (bm, bd)), dtype)
        dy = _load(dy_ref, rows, f_cols, jnp.broadcast_to((f_cols < f)[None, :], (bm, bf)), dtype)
        return acc + plgpu.dot(x, dy, trans_a=True)

    start = start_ref[g]
    acc = jax.lax.fori_loop(start, start + count_ref[g], step, jnp.zeros((bd, bf), jnp.float32))
    mask = (d_cols < d)[:, None] & (f_cols < f)[None, :]
    plgpu.store(dw_ref.at[(g * d + d_cols)[:, None], f_cols[None, :]], acc.astype(dw_ref.dtype), mask=mask)


def _tile(size: int, wanted: int) -> int:
    return max(16, min(wanted, pl.next_power_of_2(size)))


def _shared_memory() -> int:
    """Shared memory per block (opt-in) of the GPU being compiled for, from jaxmem's GPU targets by compute
    capability: the default device (jaxmem.runtime.aot's lowering_target sets it for a deviceless compile),
    else the first device; the targets' smallest (sm_89's) for a GPU none of them is."""
    by_capability = {".".join(map(str, t.compute_capability)): t.shared_memory_per_block_optin
                     for t in TARGETS.values()}
    device = jax.config.jax_default_device or jax.devices()[0]
    return by_capability.get(str(getattr(device, "compute_capability", "")), min(by_capability.values()))


def _fit(a: int, b: int, elems: Callable[[int, int], int], itemsize: int, blocks: GroupedMatmulBlocks
         ) -> tuple[int, int, int]:
    """(a, b, stages): a kernel's two column tiles and its pipeline stages, halved from the configured ones (b
    first, then a, to 32; then fewer stages) until stages x elems(a, b) x itemsize, its tiles in flight, fit
    the GPU's shared memory. The configured tiles asked for more than there is in fp32, and in bf16 on sm_89
    (Qwen3-30B-A3B widths, compiled deviceless); bf16 on sm_80 and sm_90 keeps them."""
    budget, stages = _shared_memory(), blocks.num_stages
    while stages * elems(a, b) * itemsize > budget:
        if b > 32:
            b //= 2
        elif a > 32:
            a //= 2
        elif stages > 1:
            stages -= 1
        else:
            break
    return a, b, stages


def _params(blocks: GroupedMatmulBlocks, stages: int):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=stages)


def _layout(lhs, rhs, group_sizes, blocks):
    block = blocks.block_rows
    n_blocks = padded_blocks(lhs.shape[0], rhs.shape[0], block)
    return block, n_blocks, block_layout(group_sizes, lhs.shape[0], block, n_blocks)


def _blocks_matmul(x_pad, w2, layout, out_dtype, *, k_dim, n_dim, transpose, blocks, interpret):
    """[P, K] padded rows times their groups' weights (w2: [G * K, N], or [G * N, K] with transpose) -> [P, N]."""
    bm = blocks.block_rows
    bk, bn, stages = _fit(_tile(k_dim, blocks.pallas_block_k), _tile(n_dim, blocks.pallas_block_n),
                          lambda k, n: bm * k + k * n, max(x_pad.dtype.itemsize, w2.dtype.itemsize), blocks)
    n_blocks = x_pad.shape[0] // bm
    kernel = functools.partial(_matmul_kernel, bm=bm, bk=bk, bn=bn, k_dim=k_dim, n_dim=n_dim, transpose=transpose)
    return pl.pallas_call(
        kernel, grid=(n_blocks, pl.cdiv(n_dim, bn)),
        out_shape=jax.ShapeDtypeStruct((x_pad.shape[0], n_dim), out_dtype),
        compiler_params=_params(blocks, stages), interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * x_pad.shape[0] * k_dim * n_dim, transcendentals=0,
                                      bytes_accessed=(x_pad.size + w2.size + x_pad.shape[0] * n_dim) * 2),
        name="grouped_matmul_bwd_lhs" if transpose else "grouped_matmul_fwd",
    )(layout.block_group, layout.used_blocks.reshape(1), x_pad, w2)


def _forward(lhs, rhs, group_sizes, out_dtype, blocks, interpret):
    groups, d, f = rhs.shape
    _, _, layout = _layout(lhs, rhs, group_sizes, blocks)
    y_pad = _blocks_matmul(take_rows(lhs, layout.gather_p), rhs.reshape(groups * d, f), layout, out_dtype,
                           k_dim=d, n_dim=f, transpose=False, blocks=blocks, interpret=interpret)
    return take_rows(y_pad, layout.scatter_m)


def _output_grad(dy, lhs, rhs):
    """The output gradient as the backward reads it: in the inputs' dtype. A bf16 x bf16 grouped matmul with an
    fp32 output (a LoRA adapter's, preferred_element_type) gets an fp32 gradient, gathered whole to padded rows:
    at QLoRA Qwen3-30B-A3B widths the largest buffer at the backward's peak, an fp32 [P, D] (`jaxmem explain`;
    benchmarks/constants.md, grouped_matmul). Rounded, it feeds bf16 products accumulated in fp32, as the
    gradient of a bf16 output would. The blocked kernel keeps the fp32 gradient: its peak holds the fp32
    forward output instead, and the cast added to it there."""
    return dy.astype(jnp.promote_types(lhs.dtype, rhs.dtype))


def _backward(lhs, rhs, group_sizes, dy, blocks, interpret):
    groups, d, f = rhs.shape
    dy = _output_grad(dy, lhs, rhs)
    block, _, layout = _layout(lhs, rhs, group_sizes, blocks)
    x_pad, dy_pad = take_rows(lhs, layout.gather_p), take_rows(dy, layout.gather_p)
    dx_pad = _blocks_matmul(dy_pad, rhs.reshape(groups * d, f), layout, lhs.dtype, k_dim=f, n_dim=d,
                            transpose=True, blocks=blocks, interpret=interpret)
    count = (group_sizes.astype(jnp.int32) + block - 1) // block
    start = jnp.cumsum(count) - count
    bd, bf, stages = _fit(_tile(d, blocks.pallas_block_n), _tile(f, blocks.pallas_block_n),
                          lambda a, b: block * (a + b), max(x_pad.dtype.itemsize, dy_pad.dtype.itemsize), blocks)
    dw = pl.pallas_call(
        functools.partial(_dw_kernel, bm=block, bd=bd, bf=bf, d=d, f=f),
        grid=(groups, pl.cdiv(d, bd), pl.cdiv(f, bf)),
        out_shape=jax.ShapeDtypeStruct((groups * d, f), rhs.dtype),
        compiler_params=_params(blocks, stages), interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * x_pad.shape[0] * d * f, transcendentals=0,
                                      bytes_accessed=(x_pad.size + dy_pad.size + rhs.size) * 2),
        name="grouped_matmul_bwd_rhs",
    )(start, count, x_pad, dy_pad)
    return take_rows(dx_pad, layout.scatter_m), dw.reshape(groups, d, f)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_matmul(lhs, rhs, group_sizes, out_dtype, blocks, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, blocks, interpret)


def _grouped_matmul_fwd(lhs, rhs, group_sizes, out_dtype, blocks, interpret):
    return _forward(lhs, rhs, group_sizes, out_dtype, blocks, interpret), (lhs, rhs, group_sizes)


def _grouped_matmul_bwd(out_dtype, blocks, interpret, residuals, dy):
    lhs, rhs, group_sizes = residuals
    d_lhs, d_rhs = _backward(lhs, rhs, group_sizes, dy, blocks, interpret)
    return d_lhs, d_rhs, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


def grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type=None,
                   blocks: GroupedMatmulBlocks = GroupedMatmulBlocks(), interpret: bool = False):
    """lhs [M, D] (rows sorted by group), rhs [G, D, F], group_sizes [G] int -> [M, F], as jax.lax.ragged_dot;
    products accumulate in fp32. blocks.block_rows is the rows tile (a power of two >= 16)."""
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    return _grouped_matmul(*compat.match_varying(lhs, rhs, group_sizes), out_dtype, blocks, interpret)
