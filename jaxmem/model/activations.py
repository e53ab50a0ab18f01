"""The gated MLPs' activations by name (model.activation): one table for the dense MLP and the experts."""
from __future__ import annotations

import functools
from typing import Callable

import jax

ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Qwen, Mistral)
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU (Gemma: gelu_pytorch_tanh)
}
