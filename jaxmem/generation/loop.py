"""The generation program: a prefill of left-padded prompts, then a compiled decode loop (lax.while_loop) that
stops once every row has produced a stop token or the token budget is spent.

`generate_fn` returns a pure function of (weights, prompts, starts, key, budget): jit it, or call it inside a
larger program (a rollout). Its shapes are static: prompts [B, P] and the output [B, N] with P and N buckets
(jaxmem.generation.buckets), the cache P + N slots; the budget (<= N) is a traced scalar, so neither a new prompt
length within a bucket nor a new budget recompiles.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.generation.decoder import Decoder
from jaxmem.generation.sampling import Sampling, next_token
from jaxmem.model import kv_cache


@dataclasses.dataclass(frozen=True)
class Completions:
    """tokens [B, N]: the new tokens, `pad_id` after a row's stop token; lengths [B]: each row's count of new
    tokens, its stop token included."""

    tokens: jax.Array
    lengths: jax.Array


def left_pad(prompts: list[list[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [B, width] with each prompt at the right end, starts [B]: the first real slot of each row)."""
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    starts = np.zeros((len(prompts),), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = prompt
        starts[row] = width - len(prompt)
    return tokens, starts


def generate_fn(decoder: Decoder, *, max_new: int, sampling: Sampling = Sampling(), stop_ids=(), pad_id: int = 0,
                cache_dtype=None):
    """fn(weights, prompts_bp, starts_b, key, budget=max_new) -> Completions with N = max_new columns.

    `weights` as the decoder takes them; `key` a jax PRNG key (step i draws with fold_in(key, i), whatever
    the loop's length); `cache_dtype` the cache's dtype (default the decoder's compute dtype, or "int8")."""
    stops = jnp.asarray(tuple(stop_ids) or (-1,), jnp.int32)
    cache_dtype = decoder.compute_dtype if cache_dtype is None else cache_dtype

    def run(weights, prompts_bp, starts_b, key, budget=max_new):
        b, p = prompts_bp.shape
        cache = kv_cache.init_cache(decoder.cfg, starts_b, p + max_new, cache_dtype)
        columns = jnp.arange(p, dtype=jnp.int32)[None]
        positions = jnp.maximum(columns - starts_b[:, None], 0)
        segments = (columns >= starts_b[:, None]).astype(jnp.int32)
        logits, cache = decoder.forward(weights, prompts_bp, positions, cache, segments, True)
        first = next_token(logits, jax.random.fold_in(key, 0), sampling)
        out = jnp.full((b, max_new), pad_id, jnp.int32).at[:, 0].set(first)
        done = jnp.isin(first, stops)

        def more(carry):
            i, _, _, _, done = carry
            return (i < jnp.minimum(budget, max_new)) & ~jnp.all(done)

        def step(carry):
            i, token, cache, out, done = carry
            positions = (cache.length - starts_b)[:, None]
            logits, cache = decoder.forward(weights, token[:, None], positions, cache, None, False)
            token = jnp.where(done, pad_id, next_token(logits, jax.random.fold_in(key, i), sampling))
            out = jax.lax.dynamic_update_index_in_dim(out, token, i, 1)
            return i + 1, token, cache, out, done | jnp.isin(token, stops)

        _, _, _, out, _ = jax.lax.while_loop(more, step, (jnp.ones((), jnp.int32), first, cache, out, done))
        return Completions(out, completion_lengths(out, stops, jnp.minimum(budget, max_new)))

    return run


def completion_lengths(tokens_bn, stops, budget) -> jax.Array:
    """[B]: new tokens up to and including each row's first stop token (the budget where there is none)."""
    n = tokens_bn.shape[1]
    stopped = jnp.isin(tokens_bn, stops) & (jnp.arange(n)[None] < budget)
    first = jnp.argmax(stopped, axis=1)
    return jnp.where(jnp.any(stopped, axis=1), first + 1, budget).astype(jnp.int32)


jax.tree_util.register_dataclass(Completions, data_fields=["tokens", "lengths"], meta_fields=[])
