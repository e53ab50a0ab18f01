"""The key/value cache of generation: one ring buffer of slots per layer kind, filled by a prefill and a token
at a time by the decode steps (jaxmem.model.cached runs the layers over it).

Rows are left-padded to a common prompt length, so slot s of every row is written at the same step; row b's
tokens start at slot `start[b]` (its position is s - start[b]). Each layer kind keeps a ring of `capacity` slots:
slot s lives at s % capacity. Global layers hold every slot (capacity = the slots the run needs); sliding-window
layers hold only their window (capacity = min(window, slots)), so a local layer's cache never grows past it.

`dtype` int8 stores each (token, kv head) vector as int8 codes times one fp32 scale (its max |x| / 127).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ModelConfig
from jaxmem.mesh.axes import constrain

INT8 = "int8"
# The logical axes of a stack [L, B, C, K, H] (and of its scales, without H): rows and kv heads split as the
# activations' are; the slots never (a decode step writes one slot at a traced index).
CACHE_AXES = (None, "act_batch", None, "act_heads", None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerStack:
    """The cache of one layer kind: k/v [L, B, C, K, H] (C the ring's capacity); int8 adds scales [L, B, C, K]."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """`stacks`: {"global": LayerStack, "local": LayerStack}, the kinds the model has; `start` [B]: each row's
    first real slot; `length`: the slots written so far (the next token's slot)."""

    stacks: dict
    start: jax.Array
    length: jax.Array


def kinds(cfg: ModelConfig) -> dict[str, int]:
    """{kind: its number of layers}: "local" (a sliding window) and "global" (every key)."""
    if not cfg.sliding_window:
        return {"global": cfg.n_layers}
    if not cfg.global_every:
        return {"local": cfg.n_layers}
    n_global = cfg.n_layers // cfg.global_every
    return {k: n for k, n in (("local", cfg.n_layers - n_global), ("global", n_global)) if n}


def capacities(cfg: ModelConfig, slots: int) -> dict[str, int]:
    """{kind: ring capacity} for a run of `slots` slots (prompt + new tokens)."""
    window = cfg.sliding_window or slots
    return {kind: (min(window, slots) if kind == "local" else slots) for kind in kinds(cfg)}


def layer_index(cfg: ModelConfig, layer):
    """(whether layer `layer` is local, its index in its kind's stack); `layer` may be traced. With global every
    g-th layer (layers g-1, 2g-1, ... global), layer i has i // g global layers before it."""
    if not (cfg.sliding_window and cfg.global_every):
        return (cfg.sliding_window > 0), layer
    g = cfg.global_every
    local = (layer + 1) % g != 0
    return local, jnp.where(local, layer - layer // g, layer // g)


def init_cache(cfg: ModelConfig, start_b: jax.Array, slots: int, dtype) -> KVCache:
    """An empty cache for rows starting at `start_b` [B] and `slots` slots, in `dtype` (a float or "int8")."""
    b = start_b.shape[0]
    quantized = dtype == INT8
    store = jnp.int8 if quantized else jnp.dtype(dtype)
    stacks = {}
    for kind, n in kinds(cfg).items():
        shape = (n, b, capacities(cfg, slots)[kind], cfg.n_kv_heads, cfg.head_dim)
        scales = (jnp.zeros(shape[:-1], jnp.float32),) * 2 if quantized else (None, None)
        stacks[kind] = LayerStack(jnp.zeros(shape, store), jnp.zeros(shape, store), *scales)
    return KVCache(stacks, start_b.astype(jnp.int32), jnp.zeros((), jnp.int32))


def _quantize(x):
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
    codes = jnp.round(x.astype(jnp.float32) / jnp.where(scale == 0, 1.0, scale)[..., None])
    return codes.astype(jnp.int8), scale


def _write_one(stack_lbckh, scale_lbck, index, x_btkh, slot0: jax.Array):
    """Writes x's T tokens (slots slot0 .. slot0 + T - 1; only the last C if T > C) into layer `index`'s ring."""
    capacity = stack_lbckh.shape[2]
    t = x_btkh.shape[1]
    n = min(t, capacity)
    x_btkh = x_btkh[:, t - n:]
    ring = (slot0 + t - n + jnp.arange(n)) % capacity
    if scale_lbck is not None:
        x_btkh, scale_btk = _quantize(x_btkh)
        layer_scale = jax.lax.dynamic_index_in_dim(scale_lbck, index, 0, keepdims=False)
        scale_lbck = jax.lax.dynamic_update_index_in_dim(scale_lbck, layer_scale.at[:, ring].set(scale_btk),
                                                         index, 0)
    layer = jax.lax.dynamic_index_in_dim(stack_lbckh, index, 0, keepdims=False)
    layer = layer.at[:, ring].set(x_btkh.astype(layer.dtype))
    return jax.lax.dynamic_update_index_in_dim(stack_lbckh, layer, index, 0), scale_lbck


def constrained(stack: LayerStack) -> LayerStack:
    """The stack with its logical axes named (CACHE_AXES; a no-op outside a sharding context)."""
    name = lambda x: None if x is None else constrain(x, CACHE_AXES[:x.ndim])  # noqa: E731
    return LayerStack(name(stack.k), name(stack.v), name(stack.k_scale), name(stack.v_scale))


def write(stack: LayerStack, index, k_btkh, v_btkh, slot0) -> LayerStack:
    """The stack with layer `index`'s new keys and values at slots slot0 .. slot0 + T - 1."""
    k, k_scale = _write_one(stack.k, stack.k_scale, index, k_btkh, slot0)
    v, v_scale = _write_one(stack.v, stack.v_scale, index, v_btkh, slot0)
    return constrained(LayerStack(k, v, k_scale, v_scale))


def read(stack: LayerStack, index, dtype) -> tuple[jax.Array, jax.Array]:
    """Layer `index`'s ring as (k, v) [B, C, K, H] in `dtype` (int8 codes times their scales)."""
    def one(x, scale):
        x = jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False)
        if scale is None:
            return x.astype(dtype)
        scale = jax.lax.dynamic_index_in_dim(scale, index, 0, keepdims=False)
        return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)

    return one(stack.k, stack.k_scale), one(stack.v, stack.v_scale)


def visible(start_b, slot_t, capacity: int, window: int | None) -> jax.Array:
    """[B, T, C]: which ring entries the queries at slots slot_t [T] see, once those slots are written: an
    entry holds the latest slot s <= the query's that maps to it; it is visible if written (s >= 0), a real
    token of the row (s >= start) and inside the window (query - s < window)."""
    ring = jnp.arange(capacity)
    slot_tc = slot_t[:, None] - jnp.mod(slot_t[:, None] - ring[None, :], capacity)
    seen = (slot_tc >= 0)[None] & (slot_tc[None] >= start_b[:, None, None])
    if window is not None:
        seen = seen & ((slot_t[:, None] - slot_tc) < window)[None]
    return seen
