"""Attention of new queries over a key/value cache (generation): plain XLA, the masks given per row.

Training's kernels mask by causality and segment ids over one sequence; a cache holds each row's earlier keys in
slots whose validity the caller knows (left padding, a ring buffer's unwritten or out-of-window slots), so the
mask comes in as [B, T, S] booleans. Same arithmetic as attention_reference (fp32 scores, the same sinks).
"""
from __future__ import annotations

import jax.numpy as jnp


def cached_attention(q_btnh, k_bskh, v_bskh, visible_bts, *, scale: float | None = None, sinks=None):
    """q [B, T, N, H] over cached k/v [B, S, K, H] (N % K == 0) where visible_bts [B, T, S] is True; returns
    [B, T, N, H] in v's dtype. A row with no visible key (and no sink) attends to nothing (0)."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    scale = h ** -0.5 if scale is None else scale
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_bskh, preferred_element_type=jnp.float32) * scale
    mask = visible_bts[:, None, None]
    scores = jnp.where(mask, scores, -1e30)
    if sinks is None:
        top = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.where(mask, jnp.exp(scores - top), 0.0)
        probs = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    else:
        sink = jnp.asarray(sinks, jnp.float32).reshape(kv, n // kv)[None, :, :, None]  # [1, K, G, 1]
        top = jnp.maximum(jnp.max(scores, axis=-1), sink)
        e = jnp.where(mask, jnp.exp(scores - top[..., None]), 0.0)
        probs = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - top))[..., None]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v_bskh.dtype), v_bskh)
    return out.reshape(b, t, n, h)

