"""Fused LM head + cross-entropy in Pallas (Triton backend): logits live only in [block_t, block_v] tiles.

Forward: one program per token block walks the vocab with an online
logsumexp (fp32) and writes per-token lse and target logit. Backward: one
program per (token block, vocab block) recomputes its logit tile, forms
dlogits and atomically adds its share of dh (fp32 [T, D]) and of dW. dW is
accumulated in fp32 per vocab slab of `slab_v` columns and written into a
W-dtype [D, V] buffer, so the fp32 scratch is [D, slab_v], not [D, V].
Vocab blocks that would run past V are pulled back to end at V and mask the
columns they re-read, so every load is in bounds (no padded copy of W).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.kernels.cross_entropy.vjp import fused_linear_cross_entropy


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _pow2_floor(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= min(n, cap):
        b *= 2
    return b


def _logit_tile(h_ref, w_ref, rows, col0, *, bv: int, bd: int):
    """fp32 [bt, bv] = h[rows, :] @ W[:, col0:col0+bv], accumulated over bd-wide steps of D."""
    bt = rows.size

    def step(k, acc):
        dk = pl.ds(k * bd, bd)
        return acc + plgpu.dot(h_ref[rows, dk], w_ref[dk, pl.ds(col0, bv)])

    return jax.lax.fori_loop(0, h_ref.shape[1] // bd, step, jnp.zeros((bt, bv), jnp.float32))


def _forward_kernel(h_ref, w_ref, labels_ref, lse_ref, target_ref, *, bt: int, bv: int, bd: int):
    v = w_ref.shape[1]
    rows = pl.ds(pl.program_id(0) * bt, bt)
    labels = labels_ref[rows]

    def vocab_block(j, carry):
        m, s, target = carry
        nominal = j * bv
        col0 = jnp.minimum(nominal, v - bv)
        col = col0 + jnp.arange(bv)
        fresh = col >= nominal
        logits = jnp.where(fresh[None, :], _logit_tile(h_ref, w_ref, rows, col0, bv=bv, bd=bd), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
        hit = (col[None, :] == labels[:, None]) & fresh[None, :]
        return m_new, s, target + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)

    init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.float32), jnp.zeros((bt,), jnp.float32))
    m, s, target = jax.lax.fori_loop(0, pl.cdiv(v, bv), vocab_block, init)
    lse_ref[rows] = m + jnp.log(s)
    target_ref[rows] = target


def _backward_kernel(h_ref, w_ref, labels_ref, lse_ref, soft_ref, onehot_ref, slab_ref, dh_in_ref, dw_in_ref,
                     dh_ref, dw_ref, *, bt: int, bv: int, bd: int):
    del dh_in_ref, dw_in_ref  # aliased to dh_ref / dw_ref: zeros or the previous slab's dh
    rows = pl.ds(pl.program_id(0) * bt, bt)
    local0 = pl.program_id(1) * bv  # column inside the slab
    col0 = slab_ref[0] + local0
    col = col0 + jnp.arange(bv)
    fresh = (col >= slab_ref[1])[None, :]  # columns below the nominal slab start belong to the previous slab
    labels = labels_ref[rows]
    logits = _logit_tile(h_ref, w_ref, rows, col0, bv=bv, bd=bd)
    p = jnp.exp(logits - lse_ref[rows][:, None])
    dlogits = p * soft_ref[rows][:, None] - jnp.where(col[None, :] == labels[:, None], onehot_ref[rows][:, None], 0.0)
    # a pulled-back block re-reads columns of the previous one: it rewrites their dW, never adds to dh twice
    dlogits_h = jnp.where(fresh, dlogits, 0.0).astype(w_ref.dtype)
    dlogits_w = dlogits.astype(h_ref.dtype)

    @pl.loop(0, h_ref.shape[1] // bd)
    def _(k):
        dk = pl.ds(k * bd, bd)
        w_tile = w_ref[dk, pl.ds(col0, bv)]
        plgpu.atomic_add(dh_ref, (rows, dk), plgpu.dot(dlogits_h, w_tile, trans_b=True))
        plgpu.atomic_add(dw_ref, (dk, pl.ds(local0, bv)), plgpu.dot(h_ref[rows, dk], dlogits_w, trans_a=True))


def _tiles(t: int, d: int, v: int, blocks: CrossEntropyBlocks):
    bt = blocks.pallas_block_t
    bv = _pow2_floor(v, blocks.pallas_block_v)
    bd = _pow2_divisor(d, blocks.pallas_block_d)
    slab = min(max(blocks.slab_v // bv, 1) * bv, (v // bv) * bv)
    return bt, bv, bd, slab


def forward_cost(t: int, d: int, v: int, itemsize: int, blocks: CrossEntropyBlocks = CrossEntropyBlocks()):
    """Cost of the forward kernel: W is streamed once per token block, h once."""
    bt, *_ = _tiles(t, d, v, blocks)
    n_t = -(-t // bt)
    return pl.CostEstimate(flops=2 * t * d * v, transcendentals=t * v,
                           bytes_accessed=itemsize * (n_t * d * v + t * d) + 12 * t)


def backward_cost(t: int, d: int, v: int, itemsize: int, blocks: CrossEntropyBlocks = CrossEntropyBlocks()):
    """Cost of the backward kernels: logits recomputed, then dh and dW; W read twice per token block."""
    bt, bv, *_ = _tiles(t, d, v, blocks)
    n_t, n_v = -(-t // bt), -(-v // bv)
    return pl.CostEstimate(flops=6 * t * d * v, transcendentals=t * v,
                           bytes_accessed=itemsize * (2 * n_t * d * v + 2 * n_v * t * d)
                           + 4 * 2 * (n_t * d * v + n_v * t * d))  # fp32 atomic read + write of dW and dh


def _pad_tokens(h_td, labels_t, bt: int, ignore_index: int):
    pad = -h_td.shape[0] % bt
    if pad:
        h_td = jnp.pad(h_td, ((0, pad), (0, 0)))
        labels_t = jnp.pad(labels_t, (0, pad), constant_values=ignore_index)
    return h_td, labels_t.astype(jnp.int32)


def forward_stats(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                  interpret: bool = False):
    """Per-token logsumexp and target logit (fp32); a label outside [0, V) has target 0."""
    t, d = h_td.shape
    v = w_dv.shape[1]
    bt, bv, bd, _ = _tiles(t, d, v, blocks)
    h_pad, labels_pad = _pad_tokens(h_td, labels_t, bt, ignore_index)
    tp = h_pad.shape[0]
    out = jax.ShapeDtypeStruct((tp,), jnp.float32)
    lse, target = pl.pallas_call(
        functools.partial(_forward_kernel, bt=bt, bv=bv, bd=bd),
        grid=(tp // bt,), out_shape=(out, out),
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        cost_estimate=forward_cost(t, d, v, h_td.dtype.itemsize, blocks),
        interpret=interpret, name="linear_cross_entropy_fwd",
    )(h_pad, w_dv, labels_pad)
    return lse[:t], target[:t]


def backward_grads(h_td, w_dv, labels_t, lse, g, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                   z_loss: float = 0.0, interpret: bool = False):
    """(dh, dW) of g * loss_sum, given the global per-token lse (the vocab may be a shard)."""
    t, d = h_td.shape
    v = w_dv.shape[1]
    bt, bv, bd, slab = _tiles(t, d, v, blocks)
    h_pad, labels_pad = _pad_tokens(h_td, labels_t, bt, ignore_index)
    tp = h_pad.shape[0]
    valid = labels_pad != ignore_index
    lse = jnp.pad(lse, (0, tp - t))
    # d(loss)/d(logit) = g ((1 + 2 z lse) softmax - onehot) on valid tokens
    soft = jnp.where(valid, g * (1.0 + 2.0 * z_loss * lse), 0.0).astype(jnp.float32)
    onehot = jnp.where(valid, g, 0.0).astype(jnp.float32)
    call = pl.pallas_call(
        functools.partial(_backward_kernel, bt=bt, bv=bv, bd=bd),
        grid=(tp // bt, slab // bv),
        out_shape=(jax.ShapeDtypeStruct((tp, d), jnp.float32), jax.ShapeDtypeStruct((d, slab), jnp.float32)),
        input_output_aliases={7: 0, 8: 1},
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        cost_estimate=backward_cost(t, d, slab, h_td.dtype.itemsize, blocks),
        interpret=interpret, name="linear_cross_entropy_bwd",
    )

    def one_slab(s, carry):
        dh, dw = carry
        nominal = s * slab
        start = jnp.minimum(nominal, v - slab)
        dh, dw_slab = call(h_pad, w_dv, labels_pad, lse, soft, onehot, jnp.stack([start, nominal]).astype(jnp.int32),
                           dh, jnp.zeros((d, slab), jnp.float32))
        return dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_slab.astype(dw.dtype), start, axis=1)

    init = (jnp.zeros((tp, d), jnp.float32), jnp.zeros((d, v), w_dv.dtype))
    dh, dw = jax.lax.fori_loop(0, -(-v // slab), one_slab, init)
    return dh[:t].astype(h_td.dtype), dw


_fused = fused_linear_cross_entropy(forward_stats, backward_grads)


def linear_cross_entropy(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                                ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0, interpret: bool = False):
    """(sum of per-token losses over valid tokens, number of valid tokens), like the reference."""
    return _fused(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, (("interpret", interpret),))


def scratch_bytes(tokens: int, vocab: int, blocks: CrossEntropyBlocks) -> int:
    """Loss-phase bytes beyond inputs and outputs: one fp32 [block_t, block_v] tile and its gradient, plus the
    per-token logsumexp and target logit. (The jax-triton kernels use the same tiles.)"""
    return 2 * min(tokens, blocks.pallas_block_t) * min(vocab, blocks.pallas_block_v) * 4 + 2 * tokens * 4
