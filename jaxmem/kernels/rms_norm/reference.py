"""Plain-XLA RMSNorm: the executable spec for the fused kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm_reference(x, weight, eps: float = 1e-6):
    """y = x / rms(x) * weight, computed in fp32 and returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return ((x32 * inv) * weight.astype(jnp.float32)).astype(x.dtype)
