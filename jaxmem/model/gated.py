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


def gated_reference(activation: str, gate, up):
    """act(gate) * up in the inputs' dtype: the spec (and the forward of `gated_activation`)."""
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
    act32, act_vjp = jax.vjp(ACTIVATIONS[activation], gate.astype(jnp.float32))
    (d_gate,) = act_vjp(g32 * up.astype(jnp.float32))
    return d_gate.astype(gate.dtype), (g32 * act32).astype(up.dtype)


gated_activation.defvjp(_fwd, _bwd)
