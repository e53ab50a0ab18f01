"""Fused LM head + cross-entropy as Triton kernels called through jax-triton (`triton_call`).

Same algorithm as the Pallas version (online logsumexp forward; backward
tiles that atomically add dh and an fp32 dW slab), written in Triton itself.
It has no CPU path in JAX: it is compiled for `compute_capability` (sm_90 by
default, so it also builds deviceless). Its numerics are checked on CPU by
running the very same kernels under Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.kernels.cross_entropy.vjp import fused_linear_cross_entropy

COMPUTE_CAPABILITY = 90


@triton.jit
def _logit_tile(h_ptr, w_ptr, rows, rmask, cols, cmask, D: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BV: tl.constexpr, BD: tl.constexpr):
    acc = tl.zeros((BT, BV), dtype=tl.float32)
    for d0 in range(0, D, BD):
        dk = d0 + tl.arange(0, BD)
        dmask = dk < D
        h = tl.load(h_ptr + rows[:, None] * D + dk[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(w_ptr + dk[:, None] * V + cols[None, :], mask=dmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(h, w, acc)
    return acc


@triton.jit
def forward_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, target_ptr, T: tl.constexpr, D: tl.constexpr,
                   V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    labels = tl.load(labels_ptr + rows, mask=rmask, other=-1)
    m = tl.full((BT,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BT,), dtype=tl.float32)
    target = tl.zeros((BT,), dtype=tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        cmask = cols < V
        logits = _logit_tile(h_ptr, w_ptr, rows, rmask, cols, cmask, D, V, BT, BV, BD)
        logits = tl.where(cmask[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logits - m_new[:, None]), axis=1)
        target += tl.sum(tl.where(cols[None, :] == labels[:, None], logits, 0.0), axis=1)
        m = m_new
    tl.store(lse_ptr + rows, m + tl.log(s), mask=rmask)
    tl.store(target_ptr + rows, target, mask=rmask)


@triton.jit
def backward_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, soft_ptr, onehot_ptr, slab_ptr, dh_in_ptr, dh_ptr, dw_ptr,
                    T: tl.constexpr, D: tl.constexpr, V: tl.constexpr, SLAB: tl.constexpr, BT: tl.constexpr,
                    BV: tl.constexpr, BD: tl.constexpr):
    # dh_in_ptr is aliased to dh_ptr (the running dh of earlier slabs); only dh_ptr is used
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    local = tl.program_id(1) * BV + tl.arange(0, BV)
    start = tl.load(slab_ptr)
    nominal = tl.load(slab_ptr + 1)
    cols = start + local
    cmask = (local < SLAB) & (cols < V)
    labels = tl.load(labels_ptr + rows, mask=rmask, other=-1)
    logits = _logit_tile(h_ptr, w_ptr, rows, rmask, cols, cmask, D, V, BT, BV, BD)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    soft = tl.load(soft_ptr + rows, mask=rmask, other=0.0)
    onehot = tl.load(onehot_ptr + rows, mask=rmask, other=0.0)
    dlogits = tl.exp(logits - lse[:, None]) * soft[:, None]
    dlogits -= tl.where(cols[None, :] == labels[:, None], onehot[:, None], 0.0)
    dlogits = tl.where(cmask[None, :] & rmask[:, None], dlogits, 0.0)
    # a slab pulled back to end at V re-reads columns of the previous slab: rewrite their dW, add no dh
    dlogits_h = tl.where(cols[None, :] >= nominal, dlogits, 0.0)
    for d0 in range(0, D, BD):
        dk = d0 + tl.arange(0, BD)
        dmask = dk < D
        w = tl.load(w_ptr + dk[:, None] * V + cols[None, :], mask=dmask[:, None] & cmask[None, :], other=0.0)
        h = tl.load(h_ptr + rows[:, None] * D + dk[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        dh = tl.dot(dlogits_h.to(w.dtype), tl.trans(w))
        tl.atomic_add(dh_ptr + rows[:, None] * D + dk[None, :], dh, mask=rmask[:, None] & dmask[None, :])
        dw = tl.dot(tl.trans(h), dlogits.to(h.dtype))
        tl.atomic_add(dw_ptr + dk[:, None] * SLAB + local[None, :], dw, mask=dmask[:, None] & cmask[None, :])


def tiles(t: int, d: int, v: int, blocks: CrossEntropyBlocks):
    """(block_t, block_v, block_d, slab): Triton tiles are powers of two >= 16 (tl.dot)."""
    bt = max(16, triton.next_power_of_2(min(blocks.pallas_block_t, t)))
    bv = max(16, min(blocks.pallas_block_v, triton.next_power_of_2(v)))
    bd = max(16, min(blocks.pallas_block_d, triton.next_power_of_2(d)))
    slab = min(max(blocks.slab_v // bv, 1) * bv, max(bv, (v // bv) * bv))
    return bt, bv, bd, slab


def forward_stats(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                  compute_capability: int = COMPUTE_CAPABILITY):
    """Per-token logsumexp and target logit (fp32); a label outside [0, V) has target 0."""
    import jax_triton

    t, d = h_td.shape
    v = w_dv.shape[1]
    bt, bv, bd, _ = tiles(t, d, v, blocks)
    out = jax.ShapeDtypeStruct((t,), jnp.float32)
    return jax_triton.triton_call(
        h_td, w_dv, labels_t.astype(jnp.int32), kernel=forward_kernel, out_shape=(out, out),
        grid=(triton.cdiv(t, bt),), num_warps=blocks.num_warps, num_stages=blocks.num_stages,
        compute_capability=compute_capability, name="linear_cross_entropy_fwd_triton",
        T=t, D=d, V=v, BT=bt, BV=bv, BD=bd)


def backward_grads(h_td, w_dv, labels_t, lse, g, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                   z_loss: float = 0.0, compute_capability: int = COMPUTE_CAPABILITY):
    """(dh, dW) of g * loss_sum, given the global per-token lse (the vocab may be a shard)."""
    import jax_triton

    t, d = h_td.shape
    v = w_dv.shape[1]
    bt, bv, bd, slab = tiles(t, d, v, blocks)
    valid = labels_t != ignore_index
    soft = jnp.where(valid, g * (1.0 + 2.0 * z_loss * lse), 0.0).astype(jnp.float32)
    onehot = jnp.where(valid, g, 0.0).astype(jnp.float32)
    labels = labels_t.astype(jnp.int32)
    width = min(slab, v)

    def one_slab(s, carry):
        dh, dw = carry
        nominal = s * slab
        start = jnp.maximum(jnp.minimum(nominal, v - slab), 0)
        dh, dw_slab = jax_triton.triton_call(
            h_td, w_dv, labels, lse, soft, onehot, jnp.stack([start, nominal]).astype(jnp.int32), dh,
            kernel=backward_kernel,
            out_shape=(jax.ShapeDtypeStruct((t, d), jnp.float32), jax.ShapeDtypeStruct((d, slab), jnp.float32)),
            grid=(triton.cdiv(t, bt), slab // bv), input_output_aliases={7: 0}, zeroed_outputs=(1,),
            num_warps=blocks.num_warps, num_stages=blocks.num_stages, compute_capability=compute_capability,
            name="linear_cross_entropy_bwd_triton", T=t, D=d, V=v, SLAB=slab, BT=bt, BV=bv, BD=bd)
        update = dw_slab[:, :width].astype(dw.dtype)
        return dh, jax.lax.dynamic_update_slice_in_dim(dw, update, start, axis=1)

    init = (jnp.zeros((t, d), jnp.float32), jnp.zeros((d, v), w_dv.dtype))
    dh, dw = jax.lax.fori_loop(0, triton.cdiv(v, slab), one_slab, init)
    return dh.astype(h_td.dtype), dw


_fused = fused_linear_cross_entropy(forward_stats, backward_grads)


def linear_cross_entropy(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                         ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0):
    """(sum of per-token losses over valid tokens, number of valid tokens), like the reference."""
    return _fused(h_td, w_dv, labels_t, blocks, ignore_index, z_loss)
