"""The gated activation act(gate) * up of a gated MLP, with a lean backward.

Plain autodiff keeps, besides gate and up, act(gate) and the activation's internals (SiLU: the sigmoid,
its complement, x * sigmoid) for the backward: four more [B, T, d_ff] values per layer under remat none.
This custom VJP keeps only gate and up (their dtype: the compute dtype) and recomputes act(gate) and its
derivative elementwise in the backward (fp32 inside; one fused pass, no extra memory).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen, Mistral)
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU (Gemma: gelu_pytorch_tanh)
}


SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's (transformers' swiglu_alpha, swiglu_limit)


def swiglu_clamped(gate, up):
    """gpt-oss's gated activation: the gate clipped above and up clipped both ways at the limit, a sigmoid
    sharpened by alpha, and up + 1 as the multiplier."""
    g = jnp.minimum(gate, SWIGLU_LIMIT)
    return (jnp.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT) + 1) * (g * jax.nn.sigmoid(SWIGLU_ALPHA * g))


def _swiglu_clamped_grads(gate, up, g):
    """(d gate, d up) of `swiglu_clamped` for the output gradient g, written out elementwise (all fp32): the
    clipped sides get no gradient, as the clamps give none."""
    clipped = jnp.minimum(gate, SWIGLU_LIMIT)
    s = jax.nn.sigmoid(SWIGLU_ALPHA * clipped)
    glu = clipped * s
    d_glu = g * (jnp.clip(up, -SWIGLU_LIMIT, SWIGLU_LIMIT) + 1)
    d_gate = jnp.where(gate <= SWIGLU_LIMIT, d_glu * (s + SWIGLU_ALPHA * glu * (1 - s)), 0.0)
    return d_gate, jnp.where(jnp.abs(up) <= SWIGLU_LIMIT, g * glu, 0.0)


# activations that are not act(gate) * up: a function of both, and its gradients (d gate, d up)
COMBINED: dict[str, Callable] = {"swiglu_clamped": swiglu_clamped}
COMBINED_GRADS: dict[str, Callable] = {"swiglu_clamped": _swiglu_clamped_grads}


def gated_reference(activation: str, gate, up):
    """act(gate) * up in the inputs' dtype: the spec (and the forward of `gated_activation`)."""
    if activation in COMBINED:
        return COMBINED[activation](gate, up)
    return ACTIVATIONS[activation](gate) * up


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_activation(activation: str, gate, up):
    """`gated_reference`'s value; its backward keeps only gate and up."""
    return gated_reference(activation, gate, up)


def _fwd(activation, gate, up):
    return gated_reference(activation, gate, up), (gate, up)


def _bwd(activation, residuals, g):
    gate, up = residuals
    g32 = g.astype(jnp.float32)
    if activation in COMBINED:
        d_gate, d_up = COMBINED_GRADS[activation](gate.astype(jnp.float32), up.astype(jnp.float32), g32)
        return d_gate.astype(gate.dtype), d_up.astype(up.dtype)
    act32, act_vjp = jax.vjp(ACTIVATIONS[activation], gate.astype(jnp.float32))
    (d_gate,) = act_vjp(g32 * up.astype(jnp.float32))
    return d_gate.astype(gate.dtype), (g32 * act32).astype(up.dtype)


gated_activation.defvjp(_fwd, _bwd)
