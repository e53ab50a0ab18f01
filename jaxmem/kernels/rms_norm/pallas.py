"""Fused RMSNorm in Pallas (Triton backend): one pass forward, one pass backward, no fp32 copies of x.

Forward saves only the per-row 1/rms (fp32). Backward gives dx per row block
and a per-block partial of dw (already summed over the block's rows); the
partials, [rows / block, D] fp32, are summed across blocks outside.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax.sharding import PartitionSpec as P

from jaxmem.mesh.axes import data_axes, is_sharded, seq_axis, token_axes
from jaxmem.kernels.rms_norm.config import RmsNormBlocks


def _tile(ref, rows, cols, d):
    mask = jnp.broadcast_to((cols < d)[None, :], (rows.size, cols.size))
    return plgpu.load(ref.at[rows[:, None], cols[None, :]], mask=mask, other=0).astype(jnp.float32), mask


def _forward_kernel(x_ref, w_ref, y_ref, rstd_ref, *, br: int, dp: int, eps: float):
    d = x_ref.shape[1]
    rows = pl.program_id(0) * br + jnp.arange(br)
    cols = jnp.arange(dp)
    x, mask = _tile(x_ref, rows, cols, d)
    w = plgpu.load(w_ref.at[cols], mask=cols < d, other=0).astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], ((x * rstd[:, None]) * w[None, :]).astype(y_ref.dtype),
                mask=mask)
    rstd_ref[pl.ds(pl.program_id(0) * br, br)] = rstd


def _backward_kernel(x_ref, w_ref, rstd_ref, dy_ref, dx_ref, dw_ref, *, br: int, dp: int):
    d = x_ref.shape[1]
    i = pl.program_id(0)
    rows = i * br + jnp.arange(br)
    cols = jnp.arange(dp)
    x, mask = _tile(x_ref, rows, cols, d)
    dy, _ = _tile(dy_ref, rows, cols, d)
    w = plgpu.load(w_ref.at[cols], mask=cols < d, other=0).astype(jnp.float32)
    rstd = rstd_ref[pl.ds(i * br, br)]
    x_hat = x * rstd[:, None]
    w_dy = w[None, :] * dy
    mean = jnp.sum(x_hat * w_dy, axis=1) / d
    dx = (w_dy - x_hat * mean[:, None]) * rstd[:, None]
    plgpu.store(dx_ref.at[rows[:, None], cols[None, :]], dx.astype(dx_ref.dtype), mask=mask)
    plgpu.store(dw_ref.at[i, cols], jnp.sum(dy * x_hat, axis=0), mask=cols < d)


def _layout(x, blocks: RmsNormBlocks):
    d = x.shape[-1]
    dp = pl.next_power_of_2(d)
    br = blocks.rows(dp)
    x2 = x.reshape(-1, d)
    pad = -x2.shape[0] % br
    if pad:  # zero rows: finite 1/rms, and their zero cotangent adds nothing to dw
        x2 = jnp.pad(x2, ((0, pad), (0, 0)))
    return x2, dp, br


def rms_norm_cost(rows: int, d: int, itemsize: int, backward: bool = False) -> pl.CostEstimate:
    """Elementwise FLOPs and bytes: forward reads x, writes y; backward reads x, dy, writes dx."""
    return pl.CostEstimate(flops=rows * d * (8 if backward else 4), transcendentals=rows,
                           bytes_accessed=rows * d * itemsize * (3 if backward else 2) + rows * 4)


def _forward(x, weight, eps, blocks, interpret):
    x2, dp, br = _layout(x, blocks)
    r, d = x2.shape
    y, rstd = pl.pallas_call(
        functools.partial(_forward_kernel, br=br, dp=dp, eps=eps), grid=(r // br,),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype), jax.ShapeDtypeStruct((r,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps),
        cost_estimate=rms_norm_cost(r, d, x.dtype.itemsize), interpret=interpret, name="rms_norm_fwd",
    )(x2, weight)
    n = x.size // d
    return y[:n].reshape(x.shape), rstd


def _backward(x, weight, rstd, dy, blocks, interpret):
    x2, dp, br = _layout(x, blocks)
    dy2, _, _ = _layout(dy, blocks)
    r, d = x2.shape
    dx, dw_blocks = pl.pallas_call(
        functools.partial(_backward_kernel, br=br, dp=dp), grid=(r // br,),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype), jax.ShapeDtypeStruct((r // br, d), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps),
        cost_estimate=rms_norm_cost(r, d, x.dtype.itemsize, backward=True), interpret=interpret,
        name="rms_norm_bwd",
    )(x2, weight, rstd, dy2)
    n = x.size // d
    return dx[:n].reshape(x.shape), jnp.sum(dw_blocks, axis=0)  # dw stays fp32 until every row is summed


def _row_axes(mesh, ndim: int):
    """The axes that split x's rows: data and sp for [B, T, D], the data axes for [rows, D]."""
    return token_axes(mesh) if ndim >= 3 else data_axes(mesh)


def _row_specs(mesh, ndim: int):
    """x [B, T, D] split over (data, sp, -), [rows, D] over (data, -); the per-row statistics (flat)."""
    if ndim >= 3:
        return P(data_axes(mesh), seq_axis(mesh), *([None] * (ndim - 2))), P(_row_axes(mesh, ndim))
    return P(data_axes(mesh), *([None] * (ndim - 1))), P(_row_axes(mesh, ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _rms_norm(x, weight, eps, blocks, interpret, mesh):
    return _rms_norm_fwd(x, weight, eps, blocks, interpret, mesh)[0]


def _rms_norm_fwd(x, weight, eps, blocks, interpret, mesh):
    forward = lambda x, w: tuple(_forward(x, w, eps, blocks, interpret))
    if is_sharded(mesh):  # rows per shard; the weight is whole on every device
        rows, flat = _row_specs(mesh, x.ndim)
        forward = jax.shard_map(forward, mesh=mesh, in_specs=(rows, P()), out_specs=(rows, flat), check_vma=False)
    y, rstd = forward(x, weight)
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, blocks, interpret, mesh, res, dy):
    x, weight, rstd = res

    def backward(x, w, rstd, dy):
        dx, dw = _backward(x, w, rstd, dy, blocks, interpret)
        data = _row_axes(mesh, x.ndim) if is_sharded(mesh) else None
        # dw stays fp32 until every shard's rows are summed
        return dx, (dw if data is None else jax.lax.psum(dw, data)).astype(w.dtype)

    if is_sharded(mesh):
        rows, flat = _row_specs(mesh, x.ndim)
        backward = jax.shard_map(backward, mesh=mesh, in_specs=(rows, P(), flat, rows), out_specs=(rows, P()),
                                 check_vma=False)
    return backward(x, weight, rstd, dy)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, weight, eps: float = 1e-6, *, blocks: RmsNormBlocks = RmsNormBlocks(), interpret: bool = False,
             mesh=None):
    """Like `rms_norm_reference`: x / rms(x) * weight over the last dim, fp32 inside, x's dtype out.

    With a mesh, rows are split over the data axes and dw is summed across them.
    """
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {weight.shape} != last dim of x {x.shape[-1:]}")
    return _rms_norm(x, weight, float(eps), blocks, interpret, mesh)
