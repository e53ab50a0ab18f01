"""Naive LM head + cross-entropy: materializes [T, V] logits; the spec for fused losses."""
from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100


def linear_cross_entropy_reference(h_td, w_dv, labels_t, *, ignore_index: int = IGNORE_INDEX,
                                   z_loss: float = 0.0):
    """Returns (sum of per-token losses over valid tokens, number of valid tokens)."""
    logits = jnp.einsum("TD,DV->TV", h_td, w_dv, preferred_element_type=jnp.float32)
    return cross_entropy_from_logits(logits, labels_t, ignore_index=ignore_index, z_loss=z_loss)


def cross_entropy_from_logits(logits_tv, labels_t, *, ignore_index: int = IGNORE_INDEX, z_loss: float = 0.0):
    logits = logits_tv.astype(jnp.float32)
    valid = labels_t != ignore_index
    safe = jnp.where(valid, labels_t, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    per_token = lse - target + z_loss * lse**2
    return jnp.sum(jnp.where(valid, per_token, 0.0)), jnp.sum(valid)


def linear_token_logprobs_reference(h_td, w_dv, labels_t, *, ignore_index: int = IGNORE_INDEX):
    """Per-token log-probs of the labels [T] (fp32, 0 on ignored labels) from the [T, V] logits."""
    logits = jnp.einsum("TD,DV->TV", h_td, w_dv, preferred_element_type=jnp.float32)
    valid = labels_t != ignore_index
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(valid, labels_t, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(valid, picked, 0.0)


def scratch_bytes(tokens: int, vocab: int, blocks=None, d_model: int = 0, itemsize: int = 2) -> int:
    """Loss-phase bytes beyond inputs and outputs: the fp32 [T, V] logits and their gradient."""
    return 2 * tokens * vocab * 4
