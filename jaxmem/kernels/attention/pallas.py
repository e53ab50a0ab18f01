"""Flash attention in Pallas (Triton backend): causal, GQA, segment ids, sliding window, attention sinks;
never holds [T, S] scores. With a window, every loop visits only the blocks that intersect the band of kept
scores, so time grows with T x window instead of T x T / 2.

Forward: one program per (query block, batch, q head) walks the key blocks
with an online softmax (base 2, fp32) and saves the per-row logsumexp.
Backward: dq per (query block, batch, q head); dk/dv per (key block, batch,
kv head), looping over the group's q heads so GQA needs no [B, S, N, H]
expanded copy of k or v. Sequences that are not a multiple of the blocks are
padded; padded keys are masked, padded queries get a zero cotangent.

Attention sinks (gpt-oss: one logit per q head in every row's softmax denominator, attending to no value)
start the forward's online softmax at the sink, so the saved logsumexp includes it. The backward kernels
then need no change: P = exp(S - lse) is already right and delta = rowsum(dO * O) is unchanged. The sinks'
gradient is plain JAX from lse and delta (`_sink_grad`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxmem.kernels.attention.config import AttentionBlocks, fit_shared_memory
from jaxmem.mesh.axes import data_axes, head_axes, is_sharded
from jaxmem.config.names import CheckpointName as CN

MASK = -0.7 * float(np.finfo(np.float32).max)  # finite: a fully masked block must not produce NaN
LOG2E = math.log2(math.e)


def _mask(scores, q_pos, k_pos, q_seg, k_seg, *, causal: bool, kv_len: int | None, window: int | None = None):
    keep = None
    if causal:
        keep = q_pos[:, None] >= k_pos[None, :]
    if window is not None:  # keys less than `window` positions back (transformers' sliding_window)
        near = q_pos[:, None] - k_pos[None, :] < window
        keep = near if keep is None else keep & near
    if kv_len is not None:
        inside = jnp.broadcast_to(k_pos[None, :] < kv_len, scores.shape)
        keep = inside if keep is None else keep & inside
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        keep = same if keep is None else keep & same
    return scores if keep is None else jnp.where(keep, scores, MASK)


def _key_blocks(i, n_k: int, bq: int, bk: int, causal: bool):
    """Key blocks query block i visits: causal attention skips those wholly above the diagonal. Every
    visited block is masked: running the blocks below the diagonal in a second, unmasked loop was slower
    (docs/attention.md)."""
    return jnp.minimum(n_k, ((i + 1) * bq + bk - 1) // bk) if causal else n_k


def _first_key_block(i, bq: int, bk: int, window: int | None):
    """With a window, the key blocks wholly before query block i's first query's window are skipped."""
    return 0 if window is None else jnp.maximum(i * bq - window + 1, 0) // bk


def _query_blocks_end(j, n_q: int, bq: int, bk: int, window: int | None):
    """Query blocks past this bound start after the window of key block j's last key: skipped."""
    return n_q if window is None else jnp.minimum(n_q, ((j + 1) * bk + window - 2) // bq + 1)


def _forward_kernel(q_ref, k_ref, v_ref, seg_ref, sink_ref, o_ref, lse_ref, *, scale, causal, kv_len, window, bq,
                    bk):
    i = pl.program_id(0)
    q = q_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if seg_ref is None else seg_ref[pl.ds(i * bq, bq)]

    def step(j, carry):
        o, m, l = carry
        ks = pl.ds(j * bk, bk)
        k_pos = j * bk + jnp.arange(bk)
        s = plgpu.dot(q, k_ref[ks, :], trans_b=True) * (scale * LOG2E)
        s = _mask(s, q_pos, k_pos, q_seg, None if seg_ref is None else seg_ref[ks], causal=causal, kv_len=kv_len,
                  window=window)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2(s - m_new[:, None])
        correction = jnp.exp2(m - m_new)
        o = o * correction[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[ks, :])
        return o, m_new, l * correction + jnp.sum(p, axis=1)

    h = q_ref.shape[-1]
    if sink_ref is None:
        init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), MASK, jnp.float32), jnp.zeros((bq,), jnp.float32))
    else:  # the sink as a first, value-less column: running max at it (base 2), its exp2(0) = 1 in the sum
        sink = jnp.zeros((bq,), jnp.float32) + sink_ref[...].astype(jnp.float32) * LOG2E
        init = (jnp.zeros((bq, h), jnp.float32), sink, jnp.ones((bq,), jnp.float32))
    first, upper = _first_key_block(i, bq, bk, window), _key_blocks(i, k_ref.shape[0] // bk, bq, bk, causal)
    o, m, l = jax.lax.fori_loop(first, upper, step, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale, causal, kv_len, window,
               bq, bk):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = i * bq + jnp.arange(bq)
    q_seg = None if seg_ref is None else seg_ref[pl.ds(i * bq, bq)]

    def step(j, dq):
        ks = pl.ds(j * bk, bk)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)
        s = _mask(s, q_pos, j * bk + jnp.arange(bk), q_seg, None if seg_ref is None else seg_ref[ks],
                  causal=causal, kv_len=kv_len, window=window)
        p = jnp.exp2(s - lse[:, None])
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None])
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    upper = _key_blocks(i, k_ref.shape[0] // bk, bq, bk, causal)
    dq = jax.lax.fori_loop(_first_key_block(i, bq, bk, window), upper, step, jnp.zeros(dq_ref.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, seg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, causal,
                kv_len, window, bq, bk, group):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = j * bk + jnp.arange(bk)
    k_seg = None if seg_ref is None else seg_ref[pl.ds(j * bk, bk)]
    n_q = q_ref.shape[0] // bq
    lower = (j * bk) // bq if causal else 0

    def step(g, i, carry):
        dk, dv = carry
        qs = pl.ds(i * bq, bq)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        s = plgpu.dot(q, k, trans_b=True) * (scale * LOG2E)
        s = _mask(s, i * bq + jnp.arange(bq), k_pos, None if seg_ref is None else seg_ref[qs], k_seg,
                  causal=causal, kv_len=kv_len, window=window)
        p = jnp.exp2(s - lse_ref[g, qs][:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta_ref[g, qs][:, None])
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    carry = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    for g in range(group):  # the q heads sharing this kv head
        carry = jax.lax.fori_loop(lower, _query_blocks_end(j, n_q, bq, bk, window), functools.partial(step, g),
                                  carry)
    dk, dv = carry
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(blocks: AttentionBlocks):
    return plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)


def score_pairs(t: int, s: int, *, causal: bool = True, window: int | None = None) -> float:
    """(query, key) pairs attention scores per head and row: T x S, half of it causal, about T x window
    with a window shorter than the sequence."""
    if window is not None and window < s:
        return t * window - window * (window - 1) / 2 if causal else t * min(2 * window - 1, s)
    return t * s * (0.5 if causal else 1.0)


def attention_cost(b, t, s, n, h, itemsize, *, causal=True, matmuls=2, passes=1, window=None) -> pl.CostEstimate:
    """FLOPs of `matmuls` [T,S]x[.,H] products per head, one exp per score, and the q/k/v/o bytes moved.

    Forward: 2 matmuls; dq: 3; dk/dv: 4 (the scores are recomputed in both backward kernels).
    """
    pairs = b * n * score_pairs(t, s, causal=causal, window=window)
    io = passes * b * (2 * t * n + 2 * s * n) * h * itemsize + b * n * t * 8
    return pl.CostEstimate(flops=int(2 * matmuls * pairs * h), transcendentals=int(pairs), bytes_accessed=int(io))


def _specs(b, t, s, n, kv, h, bq, group, seg):
    q_spec = pl.BlockSpec((None, bq, None, h), lambda i, b_, n_: (b_, i, n_, 0))
    kv_spec = pl.BlockSpec((None, s, None, h), lambda i, b_, n_: (b_, 0, n_ // group, 0))
    seg_spec = None if seg is None else pl.BlockSpec((None, t), lambda i, b_, n_: (b_, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, b_, n_: (b_, n_, i))
    return q_spec, kv_spec, seg_spec, row_spec


def _forward(q, k, v, seg, sinks=None, *, blocks, causal, scale, kv_len, window, interpret):
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    bq, bk = blocks.block_q, blocks.block_k
    q_spec, kv_spec, seg_spec, row_spec = _specs(b, t, s, n, kv, h, bq, n // kv, seg)
    sink_spec = None if sinks is None else pl.BlockSpec((None,), lambda i, b_, n_: (n_,))  # one scalar per head
    kernel = functools.partial(_forward_kernel, scale=scale, causal=causal, kv_len=kv_len, window=window, bq=bq,
                               bk=bk)
    return pl.pallas_call(
        kernel, grid=(t // bq, b, n), in_specs=[q_spec, kv_spec, kv_spec, seg_spec, sink_spec],
        out_specs=[q_spec, row_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=_params(blocks),
        cost_estimate=attention_cost(b, t, s, n, h, q.dtype.itemsize, causal=causal, window=window),
        interpret=interpret, name="flash_attention_fwd",
    )(q, k, v, seg, sinks)


def _backward(q, k, v, seg, o, lse, do, sinks=None, *, blocks, causal, scale, kv_len, window, interpret):
    """(dq, dk, dv), and with sinks their gradient per batch row [B, N] (the caller sums the rows)."""
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    group = n // kv
    bq, bk = blocks.block_q, blocks.block_k
    delta = jnp.einsum("BTNH,BTNH->BNT", o.astype(jnp.float32), do.astype(jnp.float32))
    q_spec, kv_spec, seg_spec, row_spec = _specs(b, t, s, n, kv, h, bq, group, seg)
    common = dict(scale=scale, causal=causal, kv_len=kv_len, window=window, bq=bq, bk=bk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common), grid=(t // bq, b, n),
        in_specs=[q_spec, kv_spec, kv_spec, seg_spec, q_spec, row_spec, row_spec], out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), compiler_params=_params(blocks),
        cost_estimate=attention_cost(b, t, s, n, h, q.dtype.itemsize, causal=causal, matmuls=3, window=window),
        interpret=interpret, name="flash_attention_dq",
    )(q, k, v, seg, do, lse, delta)
    group_spec = pl.BlockSpec((None, t, group, h), lambda j, b_, kh: (b_, 0, kh, 0))
    group_rows = pl.BlockSpec((None, group, t), lambda j, b_, kh: (b_, kh, 0))
    block_kv = pl.BlockSpec((None, bk, None, h), lambda j, b_, kh: (b_, j, kh, 0))
    seg_all = None if seg is None else pl.BlockSpec((None, t), lambda j, b_, kh: (b_, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, group=group, **common), grid=(s // bk, b, kv),
        in_specs=[group_spec, block_kv, block_kv, seg_all, group_spec, group_rows, group_rows],
        out_specs=[block_kv, block_kv],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(blocks), interpret=interpret, name="flash_attention_dkv",
        cost_estimate=attention_cost(b, t, s, n, h, q.dtype.itemsize, causal=causal, matmuls=4, passes=2,
                                     window=window),
    )(q, k, v, seg, do, lse, delta)
    if sinks is None:
        return dq, dk, dv
    return dq, dk, dv, _sink_grad(sinks, lse, delta, kv_len)


def _sink_grad(sinks, lse, delta, kv_len):
    """d sink [B, N] per batch row: out = sum_j p_j v_j with p_j = exp(s_j) / (exp(sink) + sum_i exp(s_i)), so
    d out / d sink = -p_sink * out and d sink = -sum over rows of p_sink * delta, p_sink = exp(sink - lse)
    (lse in base 2 here). Padded query rows (at kv_len and after) count for nothing."""
    p_sink = jnp.exp2(sinks[None, :, None] * LOG2E - lse)  # [B, N, T]
    if kv_len is not None:
        p_sink = jnp.where(jnp.arange(lse.shape[-1]) < kv_len, p_sink, 0.0)
    return -jnp.sum(p_sink * delta, axis=-1)


def _sharded(fn, mesh, kv_heads: int, has_seg: bool, ins: str, outs: str):
    """fn run per shard: batch over the data axes, heads over tp and sp as far as the kv heads split evenly
    (jaxmem.kernels.attention.sequence_parallel has already gathered the sequence).

    ins / outs name each argument's layout: x = [B, T, heads, H], r = [B, heads, T], s = segment ids,
    n = [heads] (the sinks: split with q's heads), b = [B, heads] (the sinks' gradient per batch row).
    """
    if not is_sharded(mesh):
        return fn
    data, heads = data_axes(mesh), head_axes(mesh, kv_heads)
    spec = {"x": P(data, None, heads, None), "r": P(data, heads, None), "s": P(data, None) if has_seg else P(),
            "n": P(heads), "b": P(data, heads)}
    body = fn if has_seg else (lambda q, k, v, _, *rest: fn(q, k, v, None, *rest))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec[c] for c in ins),
                           out_specs=tuple(spec[c] for c in outs), check_vma=False)
    if has_seg:
        return mapped
    # shard_map needs an array where the segment ids would be: a dummy scalar stands in for None
    return lambda q, k, v, _, *rest: mapped(q, k, v, jnp.zeros((), jnp.int32), *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10, 11))
def _flash(q, k, v, seg, sinks, blocks, causal, scale, kv_len, window, interpret, mesh):
    return _flash_fwd(q, k, v, seg, sinks, blocks, causal, scale, kv_len, window, interpret, mesh)[0]


def _flash_fwd(q, k, v, seg, sinks, blocks, causal, scale, kv_len, window, interpret, mesh):
    """sinks: fp32 [N], or None, which is no pytree leaf and is not passed on: the program without sinks is
    the one traced before sinks existed."""
    forward = functools.partial(_forward, blocks=blocks, causal=causal, scale=scale, kv_len=kv_len, window=window,
                                interpret=interpret)
    extra = () if sinks is None else (sinks,)
    o, lse = _sharded(lambda *a: tuple(forward(*a)), mesh, k.shape[2], seg is not None, "xxxs" + "n" * len(extra),
                      "xr")(q, k, v, seg, *extra)
    # Named, so that a remat policy can keep the kernel's residuals instead of rerunning it in the backward.
    o, lse = checkpoint_name((o, lse), CN.FLASH_RESIDUALS.value)
    return o, (q, k, v, seg, sinks, o, lse)


def _flash_bwd(blocks, causal, scale, kv_len, window, interpret, mesh, res, do):
    q, k, v, seg, sinks, o, lse = res
    backward = functools.partial(_backward, blocks=blocks, causal=causal, scale=scale, kv_len=kv_len,
                                 window=window, interpret=interpret)
    if sinks is None:
        dq, dk, dv = _sharded(lambda *a: tuple(backward(*a)), mesh, k.shape[2], seg is not None, "xxxsxrx", "xxx")(
            q, k, v, seg, o, lse, do)
        return dq, dk, dv, None, None
    dq, dk, dv, dsink_bn = _sharded(lambda *a: tuple(backward(*a)), mesh, k.shape[2], seg is not None, "xxxsxrxn",
                                    "xxxb")(q, k, v, seg, o, lse, do, sinks)
    return dq, dk, dv, None, jnp.sum(dsink_bn, axis=0)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, blocks: AttentionBlocks = AttentionBlocks(),
                    causal: bool = True, scale: float | None = None, window: int | None = None,
                    interpret: bool = False, mesh=None, sinks=None):
    """Attention like `attention_reference` (q [B,T,N,H], k/v [B,S,K,H], N % K == 0) -> [B,T,N,H].

    `window` (a static int): sliding-window attention; blocks wholly outside the window are skipped.
    `sinks` [N] (any float dtype, differentiable): attention sinks, one logit per q head, computed in fp32.
    With a mesh, runs per shard: batch over the data axes, heads over tp (and sp); the sinks follow q's heads.
    """
    b, t, n, h = q_btnh.shape
    s, kv = k_bskh.shape[1], k_bskh.shape[2]
    if n % kv:
        raise ValueError(f"flash_attention: q heads {n} must be a multiple of kv heads {kv}")
    if t != s:
        raise ValueError(f"flash_attention: query length {t} != key length {s}; only self-attention is supported")
    if sinks is not None:
        if jnp.shape(sinks) != (n,):
            raise ValueError(f"flash_attention: sinks shape {jnp.shape(sinks)} must be ({n},), one per query head")
        sinks = jnp.asarray(sinks).astype(jnp.float32)  # its gradient comes back in the sinks' own dtype
    scale = h**-0.5 if scale is None else float(scale)  # of the model's head_dim, before any padding
    tile_h = tile_head_dim(h)
    blocks = fit_shared_memory(blocks, tile_h, q_btnh.dtype.itemsize)
    step = max(blocks.block_q, blocks.block_k)
    pad = -t % step
    q, k, v, seg = q_btnh, k_bskh, v_bskh, segment_ids_bt
    if pad or tile_h != h:  # zero key columns add nothing to q.k; zero value columns are sliced off below
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, tile_h - h))) for x in (q, k, v))
        if seg is not None:
            seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    if seg is not None:
        seg = seg.astype(jnp.int32)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"flash_attention: window {window!r} must be a positive int (static)")
    window = None if window is None or window >= t else window  # a window as long as the sequence is none
    out = _flash(q, k, v, seg, sinks, blocks, causal, scale, t if pad else None, window, interpret, mesh)
    return out[:, :t, :, :h] if pad or tile_h != h else out


def tile_head_dim(head_dim: int) -> int:
    """The head dim the kernel's tiles hold: Triton tiles are powers of two >= 16, so another head dim (80, 96,
    Qwen3's 24, ...) is zero-padded up to the next one; q, k and v are then that much larger inside the kernel
    and in its saved residuals (docs/attention.md)."""
    return max(16, 1 << (head_dim - 1).bit_length())
