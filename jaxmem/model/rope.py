"""Rotary position embeddings, with Llama-3, linear (position interpolation) or YaRN frequency scaling."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jnp.ndarray:
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if not scaling:
        return inv
    factor = scaling["factor"]
    kind = scaling.get("rope_type", "llama3")
    if kind == "linear":  # positions divided by factor (Gemma 3's global layers)
        return inv / factor
    if kind == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv / factor + smooth * inv
    scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(mid, smoothed, scaled)


def _yarn(inv, head_dim: int, theta: float, scaling: dict):
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the original context are
    interpolated (divided by factor), those turning more than beta_fast times kept, a linear ramp between
    (over the frequency index; `truncate` rounds the ramp's ends to whole indices, as transformers does)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def index_turning(turns: float) -> float:  # the frequency index that turns `turns` times over `original`
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(scaling.get("beta_fast", 32.0)), index_turning(scaling.get("beta_slow", 1.0))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = jnp.asarray(1 - ramp)  # 1: the original frequency, 0: interpolated
    return inv / factor * (1 - keep) + inv * keep


def attention_factor(scaling: dict | None) -> float:
    """YaRN's scale on the rotated q and k (transformers multiplies cos and sin by it): 0.1 ln(factor) + 1, or
    the mapping's own `attention_factor`; 1 for every other scaling."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if scaling["factor"] <= 1 else 0.1 * math.log(scaling["factor"]) + 1.0


def apply_rope(x_btnh: jnp.ndarray, positions_bt: jnp.ndarray, inv_freq: jnp.ndarray,
               scale: float = 1.0) -> jnp.ndarray:
    """Rotates halves (HF convention: first half pairs with second half); `scale` multiplies the result
    (attention_factor)."""
    angles = positions_bt[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x = x_btnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_btnh.dtype)
