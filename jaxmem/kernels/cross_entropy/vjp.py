"""The custom_vjp wrappers shared by every fused loss: forward stats -> loss (or per-token log-probs), saved
lse -> (dh, dW)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp



def loss_sum(lse, target, labels_t, ignore_index, z_loss):
    """Sum over valid tokens of lse - target + z_loss * lse^2 (the reference's per-token loss)."""
    valid = labels_t != ignore_index
    per_token = lse - target + z_loss * lse * lse
    return jnp.sum(jnp.where(valid, per_token, 0.0))


def fused_linear_cross_entropy(forward_stats, backward_grads):
    """Builds `fn(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, options) -> (loss_sum, n_valid)`.

    `forward_stats` / `backward_grads` follow chunked.py's signatures; `options` is a tuple of
    (keyword, value) pairs passed to both (e.g. interpret=True), kept static and hashable.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
    def loss(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, options):
        return fwd(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, options)[0]

    def fwd(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, options):
        lse, target = forward_stats(h_td, w_dv, labels_t, blocks=blocks, ignore_index=ignore_index, **dict(options))
        return loss_sum(lse, target, labels_t, ignore_index, z_loss), (h_td, w_dv, labels_t, lse)

    def bwd(blocks, ignore_index, z_loss, options, res, g):
        h_td, w_dv, labels_t, lse = res
        dh, dw = backward_grads(h_td, w_dv, labels_t, lse, g, blocks=blocks, ignore_index=ignore_index,
                                z_loss=z_loss, **dict(options))
        return dh, dw, None

    loss.defvjp(fwd, bwd)

    def linear_cross_entropy(h_td, w_dv, labels_t, blocks, ignore_index, z_loss, options=()):
        return loss(h_td, w_dv, labels_t, blocks, ignore_index, float(z_loss), options), \
            jnp.sum(labels_t != ignore_index)

    return linear_cross_entropy


def token_logprobs(lse, target, labels_t, ignore_index):
    """Per-token log-prob of the label, target - lse, and 0 where the label is ignored."""
    return jnp.where(labels_t != ignore_index, target - lse, 0.0)


def fused_linear_token_logprobs(forward_stats, backward_grads):
    """Builds `fn(h_td, w_dv, labels_t, blocks, ignore_index, options) -> logp_t [T]` (fp32, 0 on ignored
    labels) from the same forward / backward as the loss: log p = -(per-token loss), so the cotangent g_t of
    the log-probs is the loss backward's with the per-token weight -g_t. No [T, V] array exists either way."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
    def logprobs(h_td, w_dv, labels_t, blocks, ignore_index, options):
        return fwd(h_td, w_dv, labels_t, blocks, ignore_index, options)[0]

    def fwd(h_td, w_dv, labels_t, blocks, ignore_index, options):
        lse, target = forward_stats(h_td, w_dv, labels_t, blocks=blocks, ignore_index=ignore_index, **dict(options))
        return token_logprobs(lse, target, labels_t, ignore_index), (h_td, w_dv, labels_t, lse)

    def bwd(blocks, ignore_index, options, res, g_t):
        h_td, w_dv, labels_t, lse = res
        dh, dw = backward_grads(h_td, w_dv, labels_t, lse, -g_t.astype(jnp.float32), blocks=blocks,
                                ignore_index=ignore_index, z_loss=0.0, **dict(options))
        return dh, dw, None

    logprobs.defvjp(fwd, bwd)
    return logprobs
