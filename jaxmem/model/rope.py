"""Rotary position embeddings, with Llama-3 or linear (position interpolation) frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jnp.ndarray:
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if not scaling:
        return inv
    factor = scaling["factor"]
    if scaling.get("rope_type", "llama3") == "linear":  # positions divided by factor (Gemma 3's global layers)
        return inv / factor
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(mid, smoothed, scaled)


def apply_rope(x_btnh: jnp.ndarray, positions_bt: jnp.ndarray, inv_freq: jnp.ndarray) -> jnp.ndarray:
    """Rotates halves (HF convention: first half pairs with second half)."""
    angles = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
