"""LM head + cross-entropy with a Pallas (Triton backend) forward: [T, V] logits never exist.

Forward: a program per (token block, vocab split) walks its split's vocab blocks
with an online logsumexp in fp32 registers; each [block_t, block_v] logit tile
is a tensor-core matmul over D. The splits' partial logsumexps are combined
outside the kernel, so the grid fills the GPU without atomics.

Backward: the chunked loss's tiled backward (cuBLAS matmuls over [tokens, 2048]
vocab tiles: dlogits recomputed per tile, dh accumulated in fp32, each dW tile
accumulated in fp32 and written once). It beat every Pallas backward tried: one
kernel scattering dh and dW with atomic adds, and a Pallas dlogits kernel feeding
cuBLAS (benchmarks/kernels.md, benchmarks/constants.md: cross_entropy). One kernel
that owns dh or dW tiles would recompute each logit tile D / 128 times.

Vocab blocks that would run past V are pulled back to end at V and mask the
columns they re-read, so every load is in bounds (no padded copy of W).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxmem.kernels.cross_entropy import chunked
from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.kernels.cross_entropy.vjp import fused_linear_cross_entropy, fused_linear_token_logprobs

TARGET_PROGRAMS = 512  # forward grid size to aim for: a few programs per SM on the largest targets


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
    """(block_t, block_v, block_d): block_v <= V, block_d divides D."""
    bt = blocks.pallas_block_t
    bv = _pow2_floor(v, blocks.pallas_block_v)
    bd = _pow2_divisor(d, blocks.pallas_block_d)
    return bt, bv, bd


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


def forward_cost(t: int, d: int, v: int, itemsize: int, blocks: CrossEntropyBlocks = CrossEntropyBlocks()):
    """Forward kernel: one [T, D] x [D, V] matmul. Bytes: h and W read once from HBM (the programs that run
    together share W tiles through L2: the token-block axis is the grid's fastest), per-token stats written."""
    n_split, _ = _splits(-(-t // blocks.pallas_block_t), -(-v // _tiles(t, d, v, blocks)[1]))
    return pl.CostEstimate(flops=2 * t * d * v, transcendentals=t * v,
                           bytes_accessed=itemsize * (d * v + t * d) + 8 * n_split * t + 4 * t)


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
    bt, bv, bd = _tiles(t, d, v, blocks)
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
    """(dh, dW) of g * loss_sum, given the global per-token lse (the vocab may be a shard): the chunked
    loss's tiled backward (module docstring)."""
    del interpret  # the backward is plain XLA on every backend
    return chunked.backward_grads(h_td, w_dv, labels_t, lse, g, blocks=blocks, ignore_index=ignore_index,
                                  z_loss=z_loss)


_fused = fused_linear_cross_entropy(forward_stats, backward_grads)


def linear_cross_entropy(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                         ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0, interpret: bool = False):
    """(sum of per-token losses over valid tokens, number of valid tokens), like the reference."""
    return _fused(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, (("interpret", interpret),))


_fused_logprobs = fused_linear_token_logprobs(forward_stats, backward_grads)


def linear_token_logprobs(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                          ignore_index: int = IGNORE_INDEX, interpret: bool = False):
    """Per-token log-probs of the labels [T] (fp32, 0 on ignored labels), like the reference's."""
    return _fused_logprobs(h_td, w_dv, labels_t, blocks, ignore_index, (("interpret", interpret),))


def scratch_bytes(tokens: int, vocab: int, blocks: CrossEntropyBlocks, d_model: int = 0,
                  itemsize: int = 2) -> int:
    """Loss-phase bytes beyond inputs and outputs: the backward's (chunked.scratch_bytes) plus the forward's
    per-split partial statistics."""
    n_split, _ = _splits(-(-tokens // blocks.pallas_block_t), -(-vocab // min(vocab, blocks.pallas_block_v)))
    return chunked.scratch_bytes(tokens, vocab, blocks, d_model, itemsize) + 2 * n_split * tokens * 4
