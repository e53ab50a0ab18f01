"""Plain-XLA attention: the executable spec and the fallback for every attention kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids_bt=None,
                        scale: float | None = None):
    """Causal GQA attention. q [B,T,N,H], k/v [B,S,K,H] with N % K == 0; returns [B,T,N,H]."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    scale = h**-0.5 if scale is None else scale
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_bskh, preferred_element_type=jnp.float32) * scale
    s = k_bskh.shape[1]
    mask = jnp.ones((t, s), dtype=bool)
    if causal:
        mask = jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]
    mask = mask[None, None, None]
    if segment_ids_bt is not None:
        same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
        mask = mask & same[:, None, None]
    scores = jnp.where(mask, scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v_bskh)
    return out.reshape(b, t, n, h)
