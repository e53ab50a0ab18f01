"""Choosing the next token from logits: greedy, or a draw after temperature, top-k and top-p (nucleus).

Filters set the logits of excluded tokens to -inf; the draw is jax.random.categorical with an explicit key, so a
fixed seed gives the same tokens. Ties at the top-k / top-p boundary keep every tied token (a threshold on the
value), which a sort-based reference with the same threshold rule reproduces.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
    """temperature 0: greedy (argmax); top_k 0 and top_p 1.0: no filter."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature: {self.temperature} must be >= 0 (0: greedy)")
        if self.top_k < 0:
            raise ConfigError(f"top_k: {self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: {self.top_p} must be in (0, 1] (1: off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_k_filter(logits_bv: jax.Array, k: int) -> jax.Array:
    """Logits outside each row's k largest set to -inf (k = 0 or >= V: unchanged)."""
    if k <= 0 or k >= logits_bv.shape[-1]:
        return logits_bv
    kth = jax.lax.top_k(logits_bv, k)[0][..., -1:]
    return jnp.where(logits_bv < kth, -jnp.inf, logits_bv)


def top_p_filter(logits_bv: jax.Array, p: float) -> jax.Array:
    """Keeps each row's smallest set of most likely tokens whose probability reaches p (the token that crosses
    p is kept, at least one token always); the rest -inf. p = 1: unchanged."""
    if p >= 1.0:
        return logits_bv
    sorted_desc = jnp.sort(logits_bv, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc.astype(jnp.float32), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each one
    kept = before < p
    cutoff = jnp.min(jnp.where(kept, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits_bv < cutoff, -jnp.inf, logits_bv)


def next_token(logits_bv: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """[B] int32: argmax where greedy, else a draw from the filtered, temperature-scaled distribution."""
    logits_bv = logits_bv.astype(jnp.float32)
    if sampling.greedy:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    scaled = logits_bv / sampling.temperature
    scaled = top_p_filter(top_k_filter(scaled, sampling.top_k), sampling.top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
