"""The decoder's layers over a key/value cache (generation): a prefill of the prompt, then a token at a time.

The same Blocks, RoPE and MLPs as training (jaxmem.model.layers); only attention differs. A prefill attends
over the prompt's own keys through the context's kernel (segment ids keep each row's left padding out) and
stores them; a decode step stores its token's keys, then attends over the cache (jaxmem.kernels.attention.
decode: a plain einsum over the cached slots). The layer loop is the context's `scan_layers` (a feature's
per-layer fetch runs there, as in training), its carry the residual stream, the layer number and the cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmem.kernels.attention.decode import cached_attention
from jaxmem.model import kv_cache
from jaxmem.model.moe import is_moe
from jaxmem.model.transformer import ForwardContext, Transformer, layer_frequencies


def run_layers_cached(model: Transformer, h_btd, ctx: ForwardContext, positions_bt, cache: kv_cache.KVCache, *,
                      segment_ids_bt=None, prefill: bool) -> tuple[jax.Array, kv_cache.KVCache]:
    """(h [B, T, D] after the layers, the cache holding these T tokens' keys too). The T tokens sit at slots
    cache.length ... cache.length + T - 1. `prefill` (T tokens, the cache empty): attention over these tokens
    only, masked by `segment_ids_bt` (0 for left padding); otherwise attention over the cache."""
    cfg = model.cfg
    global_freq, local_freq, mixed = layer_frequencies(cfg)
    graphdef, stacked = nnx.split(model.layers)
    t = h_btd.shape[1]
    slot0 = cache.length
    slots_t = slot0 + jnp.arange(t, dtype=jnp.int32)

    def attend_fn(block, local, index, stacks):
        def one_kind(kind):
            window = block.window if kind == "local" else None

            def run(q, k, v, kwargs):
                stack = kv_cache.write(stacks[kind], index, k, v, slot0)
                if prefill:
                    extra = {} if window is None else {"window": window}
                    context = ctx.attention(q, k, v, segment_ids_bt, **extra, **kwargs)
                else:
                    k_all, v_all = kv_cache.read(stack, index, q.dtype)
                    seen = kv_cache.visible(cache.start, slots_t, stack.capacity, window)
                    context = cached_attention(q, k_all, v_all, seen, **kwargs)
                return context, dict(stacks, **{kind: stack})

            return run

        def attend(q, k, v, kwargs):
            if len(stacks) == 1:
                return one_kind(next(iter(stacks)))(q, k, v, kwargs)
            return jax.lax.cond(local, one_kind("local"), one_kind("global"), q, k, v, kwargs)

        return attend

    def step(carry, layer_state):
        h, layer, stacks = carry
        block = nnx.merge(graphdef, layer_state)
        local, index = kv_cache.layer_index(cfg, layer)
        inv_freq = jnp.where(local, local_freq, global_freq) if mixed else global_freq
        h, stacks = block.attention_part_cached(h, positions_bt, inv_freq, ctx,
                                                attend_fn(block, local, index, stacks))
        h = block.mlp_part(h, ctx)
        if is_moe(cfg):
            h = h[0]  # the router statistics serve training's losses only
        return h, layer + 1, stacks

    stacks = {kind: kv_cache.constrained(stack) for kind, stack in cache.stacks.items()}
    h_btd, _, stacks = ctx.scan_layers(step, (h_btd, jnp.zeros((), jnp.int32), stacks), stacked)
    return h_btd, kv_cache.KVCache(stacks, cache.start, cache.length + t)
