"""Pure-JAX chunked LM head + cross-entropy: tiles of [block_t, block_v] logits, never [T, V].

Forward: scan over token chunks, and inside over vocab chunks with an online
logsumexp in fp32. Backward (custom_vjp): scan over vocab chunks, and inside
over token chunks, so each dW column block is finished in one pass and
written once in W's dtype (no fp32 [D, V] accumulator), while dh accumulates
in a fp32 [T, D] buffer. Runs on every backend.

Tiles by shape (`tiles`): every local token in one tile, up to TILE_ELEMS / block_v, and narrow vocab
slabs of AUTO_BLOCK_V columns: at about the same compiled scratch, fewer and larger matmuls, and W read once
per token tile, ran faster than square tiles (benchmarks/kernels.md).
"""
from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.kernels.cross_entropy.vjp import fused_linear_cross_entropy, fused_linear_token_logprobs


def _pad_tokens(h_td, labels_t, block_t: int, ignore_index: int):
    """Pads tokens to a multiple of block_t; padded labels are ignored, so they add nothing."""
    t = h_td.shape[0]
    pad = -t % block_t
    if pad:
        h_td = jnp.pad(h_td, ((0, pad), (0, 0)))
        labels_t = jnp.pad(labels_t, (0, pad), constant_values=ignore_index)
    return h_td, labels_t


AUTO_BLOCK_V = 2048  # vocab columns per tile when kernels.loss_block_v is 0
TILE_ELEMS = 8192 * 2048  # largest [block_t, block_v] tile by shape, in fp32 logits elements


def tiles(t: int, v: int, blocks: CrossEntropyBlocks) -> tuple[int, int]:
    """(block_t, block_v) for t local tokens and v local vocab columns; 0 in `blocks` means by shape."""
    bv = min(v, blocks.block_v or AUTO_BLOCK_V)
    return min(t, blocks.block_t or max(1, TILE_ELEMS // bv)), bv


def _vocab_starts(v: int, block_v: int):
    """Start column of each vocab chunk; the last one is pulled back to end at V (it overlaps the previous)."""
    n = -(-v // block_v)
    nominal = jnp.arange(n, dtype=jnp.int32) * block_v
    return nominal, jnp.minimum(nominal, v - block_v)


@typing.runtime_checkable
class ColumnSource(typing.Protocol):
    """A [D, V] head weight that hands out its own column chunks (a frozen head stored quantized dequantizes
    one chunk at a time); the chunked loss takes it where it takes an array."""

    shape: tuple[int, int]

    def columns(self, start, size: int) -> jax.Array: ...  # columns [start, start + size) as [D, size]


def _logits_chunk(h_cd, w_dv, start, block_v):
    if isinstance(w_dv, ColumnSource):
        w_chunk = w_dv.columns(start, block_v)
    else:
        w_chunk = jax.lax.dynamic_slice_in_dim(w_dv, start, block_v, axis=1)
    return jnp.einsum("TD,DV->TV", h_cd, w_chunk, preferred_element_type=jnp.float32), w_chunk


def forward_stats(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX):
    """Per-token logsumexp and target logit (fp32); a label outside [0, V) has target 0."""
    t, v = h_td.shape[0], w_dv.shape[1]
    bt, bv = tiles(t, v, blocks)  # a short sequence is one chunk, not padded to block_t
    h_td, labels_t = _pad_tokens(h_td, labels_t, bt, ignore_index)
    nominal, starts = _vocab_starts(v, bv)
    cols = jnp.arange(bv, dtype=jnp.int32)

    def token_chunk(_, xs):
        h_cd, lab_c = xs

        def vocab_chunk(carry, vs):
            m, s, target = carry
            nom, start = vs
            logits, _ = _logits_chunk(h_cd, w_dv, start, bv)
            col = start + cols
            fresh = col >= nom  # columns the previous (overlapping) chunk already counted
            logits = jnp.where(fresh[None, :], logits, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(logits, axis=1))
            s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), axis=1)
            hit = (col[None, :] == lab_c[:, None]) & fresh[None, :]
            target = target + jnp.sum(jnp.where(hit, logits, 0.0), axis=1)
            return (m_new, s, target), None

        zero = jnp.zeros((bt,), jnp.float32)
        init = (zero - jnp.inf, zero, zero)
        (m, s, target), _ = jax.lax.scan(vocab_chunk, init, (nominal, starts))
        return None, (m + jnp.log(s), target)

    n_t = h_td.shape[0] // bt
    xs = (h_td.reshape(n_t, bt, -1), labels_t.reshape(n_t, bt))
    _, (lse, target) = jax.lax.scan(token_chunk, None, xs)
    return lse.reshape(-1)[:t], target.reshape(-1)[:t]


def backward_grads(h_td, w_dv, labels_t, lse, g, *, blocks: CrossEntropyBlocks, ignore_index: int = IGNORE_INDEX,
                   z_loss: float = 0.0):
    """(dh, dW) of g * loss_sum, given the global per-token lse (the vocab may be a shard); g is a scalar, or
    a per-token weight [T] (the per-token log-probs' backward: vjp.fused_linear_token_logprobs)."""
    t, d = h_td.shape
    v = w_dv.shape[1]
    frozen = hasattr(w_dv, "zero_cotangent")  # a frozen quantized head: no dW
    bt, bv = tiles(t, v, blocks)  # a short sequence is one chunk, not padded to block_t
    h_pad, lab_pad = _pad_tokens(h_td, labels_t, bt, ignore_index)
    n_t = h_pad.shape[0] // bt
    lse = jnp.pad(lse, (0, h_pad.shape[0] - lse.shape[0]))
    if jnp.ndim(g):
        g = jnp.pad(g, (0, h_pad.shape[0] - t))
    valid = lab_pad != ignore_index
    # d(loss)/d(logit) = g * ((1 + 2 z lse) softmax - onehot) on valid tokens
    soft_scale = jnp.where(valid, g * (1.0 + 2.0 * z_loss * lse), 0.0)
    onehot_scale = jnp.where(valid, g, 0.0)
    nominal, starts = _vocab_starts(v, bv)
    cols = jnp.arange(bv, dtype=jnp.int32)

    def vocab_chunk(carry, vs):
        dh, dw = carry
        nom, start = vs
        col = start + cols
        fresh = (col >= nom)[None, :]

        def token_chunk(carry, i):
            dh, dw_chunk = carry
            rows = i * bt
            h_cd = jax.lax.dynamic_slice_in_dim(h_pad, rows, bt)
            lab = jax.lax.dynamic_slice_in_dim(lab_pad, rows, bt)
            logits, w_chunk = _logits_chunk(h_cd, w_dv, start, bv)
            p = jnp.exp(logits - jax.lax.dynamic_slice_in_dim(lse, rows, bt)[:, None])
            dlogits = (p * jax.lax.dynamic_slice_in_dim(soft_scale, rows, bt)[:, None]
                       - jnp.where(col[None, :] == lab[:, None], 1.0, 0.0)
                       * jax.lax.dynamic_slice_in_dim(onehot_scale, rows, bt)[:, None])
            # the overlapping last chunk rewrites dW columns with equal values, but must not add to dh twice
            if not frozen:
                dw_chunk = dw_chunk + jnp.einsum("TD,TV->DV", h_cd, dlogits.astype(h_cd.dtype),
                                                 preferred_element_type=jnp.float32)
            dh_rows = jnp.einsum("TV,DV->TD", jnp.where(fresh, dlogits, 0.0).astype(w_chunk.dtype), w_chunk,
                                 preferred_element_type=jnp.float32)
            dh = jax.lax.dynamic_update_slice_in_dim(dh, jax.lax.dynamic_slice_in_dim(dh, rows, bt) + dh_rows,
                                                     rows, axis=0)
            return (dh, dw_chunk), None

        (dh, dw_chunk), _ = jax.lax.scan(token_chunk, (dh, None if frozen else jnp.zeros((d, bv), jnp.float32)),
                                         jnp.arange(n_t))
        if not frozen:
            dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, axis=1)
        return (dh, dw), None

    init = (jnp.zeros(h_pad.shape, jnp.float32), None if frozen else jnp.zeros(w_dv.shape, w_dv.dtype))
    (dh, dw), _ = jax.lax.scan(vocab_chunk, init, (nominal, starts))
    return dh[:t].astype(h_td.dtype), w_dv.zero_cotangent() if frozen else dw


_chunked = fused_linear_cross_entropy(forward_stats, backward_grads)


def linear_cross_entropy(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                         ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0):
    """(sum of per-token losses over valid tokens, number of valid tokens), like the reference."""
    return _chunked(h_td, w_dv, labels_t, blocks, ignore_index, z_loss)


_chunked_logprobs = fused_linear_token_logprobs(forward_stats, backward_grads)


def linear_token_logprobs(h_td, w_dv, labels_t, *, blocks: CrossEntropyBlocks = CrossEntropyBlocks(),
                          ignore_index: int = IGNORE_INDEX):
    """Per-token log-probs of the labels [T] (fp32, 0 on ignored labels), like the reference's."""
    return _chunked_logprobs(h_td, w_dv, labels_t, blocks, ignore_index, ())


def scratch_bytes(tokens: int, vocab: int, blocks: CrossEntropyBlocks, d_model: int = 0,
                  itemsize: int = 2) -> int:
    """Loss-phase bytes beyond inputs and outputs: one tile's fp32 logits and its dlogits (W's dtype), the
    tile's fp32 dW columns, the fp32 dh accumulator and the per-token statistics."""
    bt, bv = tiles(tokens, vocab, blocks)
    return bt * bv * (4 + itemsize) + d_model * bv * 4 + tokens * d_model * 4 + 4 * tokens * 4
