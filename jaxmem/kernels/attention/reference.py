"""Plain-XLA attention: the executable spec and the fallback for every attention kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q_btnh, k_bskh, v_bskh, *, causal: bool = True, segment_ids_bt=None,
                        scale: float | None = None, window: int | None = None, sinks=None):
    """Causal GQA attention. q [B,T,N,H], k/v [B,S,K,H] with N % K == 0; returns [B,T,N,H].

    `window` (sliding-window attention): a query sees only the keys less than `window` positions before it
    (itself included), as transformers' sliding_window. Only a mask here: the [T, S] scores are still built.

    `sinks` [N] (attention sinks, gpt-oss): one learned logit per query head, in fp32, that joins every row's
    softmax denominator as an extra column whose probability multiplies no value. Written as that
    denominator rather than a concatenated [T, S + 1] copy; a fully masked row then attends to nothing (0).
    """
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    scale = h**-0.5 if scale is None else scale
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k_bskh, preferred_element_type=jnp.float32) * scale
    s = k_bskh.shape[1]
    mask = jnp.ones((t, s), dtype=bool)
    if causal:
        mask = jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]
    if window is not None:
        mask = mask & (jnp.arange(t)[:, None] + (s - t) - jnp.arange(s)[None, :] < window)
    mask = mask[None, None, None]
    if segment_ids_bt is not None:
        same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
        mask = mask & same[:, None, None]
    scores = jnp.where(mask, scores, -1e30)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.asarray(sinks, jnp.float32).reshape(kv, n // kv)[None, :, :, None]  # [1, K, G, 1]
        top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1), sink))
        e = jnp.exp(scores - top[..., None])
        probs = e / (jnp.sum(e, axis=-1) + jnp.exp(sink - top))[..., None]
    probs = probs.astype(v_bskh.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v_bskh)
    return out.reshape(b, t, n, h)


# Per score element XLA keeps live while differentiating plain attention: fp32 scores and their fp32
# gradient, the compute-dtype probs and the boolean mask (read off `jaxmem explain` of deviceless GPU
# compiles).
_WORKING_F32_COPIES = 2
_MASK_BYTES = 1
# Per score element saved for the backward when plain attention is not rematerialized: fp32 scores and the
# fp32 softmax output, plus the compute-dtype probs fed to the second matmul; checked against deviceless
# compiles of configs/ladder/{1-fp32,2-bf16}.yaml (benchmarks/constants.md, attention).
_SAVED_F32_BYTES = 8


def scratch_bytes(score_elems: int, compute_itemsize: int) -> int:
    """One layer's backward through plain attention: the S x S working copies, for `score_elems` elements."""
    return score_elems * (4 * _WORKING_F32_COPIES + compute_itemsize + _MASK_BYTES)


def saved_bytes(score_elems: int, compute_itemsize: int) -> int:
    """Bytes per layer plain attention keeps across the backward when its scores are saved."""
    return score_elems * (_SAVED_F32_BYTES + compute_itemsize)
