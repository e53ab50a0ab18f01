"""LM head + cross-entropy with Pallas (Triton backend) logit tiles: [T, V] logits never exist.

Forward: a program per (token block, vocab split) walks its split's vocab blocks
with an online logsumexp in fp32 registers; each [block_t, block_v] logit tile
is a tensor-core matmul over D. The splits' partial logsumexps are combined
outside the kernel, so the grid fills the GPU without atomics.

Backward: vocab slabs of `slab_v` columns. A program per [block_t, block_v]
tile of the slab recomputes its logits, forms dlogits = g (softmax - onehot)
and writes them in W's dtype; then two library matmuls (cuBLAS on GPUs)
accumulate dh (fp32 [T, D]) and the slab's dW (fp32 accumulation, written
once in W's dtype). No atomics: every output element has one writer, and the
only [T, *] scratch is the slab's dlogits. Why not one kernel for all three
matmuls: a program owning a dh or dW tile needs the full-D logits of every tile
it touches, so it would recompute them once per D tile (D / 128 times);
scattering both gradients from one program needs atomic adds, which made the
previous version 8-11x slower than chunked on an H100 (benchmarks/kernels.md).

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

TARGET_PROGRAMS = 512  # forward grid size to aim for: ~4 programs per SM on a 132-SM H100


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


def _tiles(t: int, d: int, v: int, blocks: CrossEntropyBlocks):
    """(block_t, block_v, block_d, slab): block_v <= V, block_d divides D, slab a multiple of block_v <= V."""
    bt = blocks.pallas_block_t
    bv = _pow2_floor(v, blocks.pallas_block_v)
    bd = _pow2_divisor(d, blocks.pallas_block_d)
    slab = min(max(blocks.slab_v // bv, 1) * bv, (v // bv) * bv)
    return bt, bv, bd, slab


def _splits(n_token_blocks: int, n_vocab_blocks: int) -> tuple[int, int]:
    """(vocab splits, vocab blocks per split) so that the forward grid has about TARGET_PROGRAMS programs."""
    want = min(n_vocab_blocks, max(1, -(-TARGET_PROGRAMS // n_token_blocks)))
    per = -(-n_vocab_blocks // want)
    return -(-n_vocab_blocks // per), per


def _logit_tile(h_ref, w_ref, row0, col0, *, bt: int, bv: int, bd: int):
    """fp32 [bt, bv] = h[row0:row0+bt, :] @ W[:, col0:col0+bv], accumulated over bd-wide steps of D."""
    def step(k, acc):
        dk = pl.ds(pl.multiple_of(k * bd, bd), bd)
        return acc + plgpu.dot(h_ref[pl.ds(row0, bt), dk], w_ref[dk, pl.ds(col0, bv)])

    return jax.lax.fori_loop(0, h_ref.shape[1] // bd, step, jnp.zeros((bt, bv), jnp.float32))


def _block_columns(nominal, v: int, bv: int):
    """(first column read, columns, fresh mask) of the vocab block that nominally starts at `nominal`: a block
    running past V is pulled back to end at V, and columns below `nominal` (already counted) are not fresh.
    A nominal start at or past V gives a block with no fresh column."""
    col0 = jnp.minimum(nominal, v - bv)
    col = col0 + jnp.arange(bv)
    return col0, col, col >= nominal


def _forward_kernel(h_ref, w_ref, labels_ref, lse_ref, target_ref, *, bt: int, bv: int, bd: int, per: int,
                    tp: int):
    v = w_ref.shape[1]
    i, split = pl.program_id(0), pl.program_id(1)
    row0 = pl.multiple_of(i * bt, bt)
    labels = labels_ref[pl.ds(row0, bt)]

    def vocab_block(j, carry):
        m, s, target = carry
        col0, col, fresh = _block_columns((split * per + j) * bv, v, bv)
        logits = jnp.where(fresh[None, :], _logit_tile(h_ref, w_ref, row0, col0, bt=bt, bv=bv, bd=bd), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a block with no fresh column leaves the sums alone
        s = s * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(logits - m_safe[:, None]), axis=1)
        hit = (col[None, :] == labels[:, None]) & fresh[None, :]
        return m_new, s, target + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)

    init = (jnp.full((bt,), -jnp.inf, jnp.float32), jnp.zeros((bt,), jnp.float32), jnp.zeros((bt,), jnp.float32))
    m, s, target = jax.lax.fori_loop(0, per, vocab_block, init)
    out = pl.ds(split * tp + row0, bt)
    lse_ref[out] = m + jnp.log(s)  # -inf for a split with no fresh column
    target_ref[out] = target


def _dlogits_kernel(h_ref, w_ref, labels_ref, lse_ref, soft_ref, onehot_ref, slab_ref, out_ref, *, bt: int, bv: int,
                    bd: int):
    row0 = pl.multiple_of(pl.program_id(0) * bt, bt)
    local0 = pl.multiple_of(pl.program_id(1) * bv, bv)  # column inside the slab
    rows = pl.ds(row0, bt)
    col0 = slab_ref[0] + local0
    col = col0 + jnp.arange(bv)
    fresh = (col >= slab_ref[1])[None, :]  # columns below the nominal slab start belong to the previous slab
    logits = _logit_tile(h_ref, w_ref, row0, col0, bt=bt, bv=bv, bd=bd)
    p = jnp.exp(logits - lse_ref[rows][:, None])
    hit = col[None, :] == labels_ref[rows][:, None]
    dlogits = p * soft_ref[rows][:, None] - jnp.where(hit, onehot_ref[rows][:, None], 0.0)
    out_ref[rows, pl.ds(local0, bv)] = jnp.where(fresh, dlogits, 0.0).astype(out_ref.dtype)


def forward_cost(t: int, d: int, v: int, itemsize: int, blocks: CrossEntropyBlocks = CrossEntropyBlocks()):
    """Forward kernel: one [T, D] x [D, V] matmul. Bytes: h and W read once from HBM (the programs that run
    together share W tiles through L2: the token-block axis is the grid's fastest), per-token stats written."""
    n_split, _ = _splits(-(-t // blocks.pallas_block_t), -(-v // _tiles(t, d, v, blocks)[1]))
    return pl.CostEstimate(flops=2 * t * d * v, transcendentals=t * v,
                           bytes_accessed=itemsize * (d * v + t * d) + 8 * n_split * t + 4 * t)


def backward_cost(t: int, d: int, v: int, itemsize: int, blocks: CrossEntropyBlocks = CrossEntropyBlocks()):
    """dlogits kernel over all slabs: the logits recomputed (one matmul), dlogits written once in W's dtype."""
    return pl.CostEstimate(flops=2 * t * d * v, transcendentals=t * v,
                           bytes_accessed=itemsize * (d * v + t * d + t * v) + 16 * t)


def _pad_tokens(h_td, labels_t, bt: int, ignore_index: int):
    pad = -h_td.shape[0] % bt
    if pad:
        h_td = jnp.pad(h_td, ((0, pad), (0, 0)))
        labels_t = jnp.pad(labels_t, (0, pad), constant_values=ignore_index)
    return h_td, labels_t.astype(jnp.int32)


def _compiler_params(blocks: CrossEntropyBlocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def forward_stats(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                  interpret: bool = False):
    """Per-token logsumexp and target logit (fp32); a label outside [0, V) has target 0."""
    t, d = h_td.shape
    v = w_dv.shape[1]
    bt, bv, bd, _ = _tiles(t, d, v, blocks)
    h_pad, labels_pad = _pad_tokens(h_td, labels_t, bt, ignore_index)
    tp = h_pad.shape[0]
    n_split, per = _splits(tp // bt, -(-v // bv))
    out = jax.ShapeDtypeStruct((n_split * tp,), jnp.float32)
    lse, target = pl.pallas_call(
        functools.partial(_forward_kernel, bt=bt, bv=bv, bd=bd, per=per, tp=tp),
        grid=(tp // bt, n_split), out_shape=(out, out), compiler_params=_compiler_params(blocks),
        cost_estimate=forward_cost(t, d, v, h_td.dtype.itemsize, blocks),
        interpret=interpret, name="linear_cross_entropy_fwd",
    )(h_pad, w_dv, labels_pad)
    lse = jax.nn.logsumexp(lse.reshape(n_split, tp), axis=0)
    return lse[:t], jnp.sum(target.reshape(n_split, tp), axis=0)[:t]


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
    dlogits_of_slab = pl.pallas_call(
        functools.partial(_dlogits_kernel, bt=bt, bv=bv, bd=bd),
        grid=(tp // bt, slab // bv), out_shape=jax.ShapeDtypeStruct((tp, slab), w_dv.dtype),
        compiler_params=_compiler_params(blocks),
        cost_estimate=backward_cost(t, d, slab, h_td.dtype.itemsize, blocks),
        interpret=interpret, name="linear_cross_entropy_dlogits",
    )

    def one_slab(s, carry):
        dh, dw = carry
        nominal = s * slab
        start = jnp.minimum(nominal, v - slab)  # the last slab is pulled back to end at V
        dlogits = dlogits_of_slab(h_pad, w_dv, labels_pad, lse, soft, onehot,
                                  jnp.stack([start, nominal]).astype(jnp.int32))
        w_slab = jax.lax.dynamic_slice_in_dim(w_dv, start, slab, axis=1)
        dh = dh + jnp.einsum("TV,DV->TD", dlogits, w_slab, preferred_element_type=jnp.float32)
        # re-read columns carry zero dlogits: adding keeps the previous slab's values there. (Writing the
        # whole slabs in the loop and the pulled-back one after it, with no read, measured no faster on an
        # H100 and took 0.09 GiB more scratch.)
        dw_slab = jnp.einsum("TD,TV->DV", h_pad, dlogits, preferred_element_type=jnp.float32)
        dw_slab = dw_slab + jax.lax.dynamic_slice_in_dim(dw, start, slab, axis=1).astype(jnp.float32)
        return dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_slab.astype(dw.dtype), start, axis=1)

    init = (jnp.zeros((tp, d), jnp.float32), jnp.zeros((d, v), w_dv.dtype))
    dh, dw = jax.lax.fori_loop(0, -(-v // slab), one_slab, init)
    return dh[:t].astype(h_td.dtype), dw


_fused = fused_linear_cross_entropy(forward_stats, backward_grads)


def linear_cross_entropy(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                         ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0, interpret: bool = False):
    """(sum of per-token losses over valid tokens, number of valid tokens), like the reference."""
    return _fused(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, (("interpret", interpret),))


def scratch_bytes(tokens: int, vocab: int, blocks: CrossEntropyBlocks, d_model: int = 0,
                  itemsize: int = 2) -> int:
    """Loss-phase bytes beyond inputs and outputs: the slab's dlogits (W's dtype) and its fp32 dW, the fp32 dh
    accumulator, and the per-token statistics."""
    slab = min(blocks.slab_v, vocab)
    return tokens * slab * itemsize + d_model * slab * 4 + tokens * d_model * 4 + 4 * tokens * 4
