"""`lora.dropout`: PEFT-style dropout on the adapters' input, y = x W + scale * (drop(x) A) B.

With dropout the adapters cannot be merged into a layer's weights (the dropped-out input only feeds the
adapter path), so the layer scan hands each targeted projection an `AdaptedWeight` (the rebuilt base weight,
the layer's A and B and a key) and the model's projection hook (`ForwardContext.project`) runs the base
matmul and the low-rank one side by side. Only the train step passes a key; evaluation and merge-lora run
the merged path (no dropout), and `lora.dropout=0` never builds any of this.

Keys, all by jax.random.fold_in, so a step recomputed in the backward (remat) or after a resume draws the
same masks: key(train.seed) -> DOMAIN -> step -> micro-batch index -> layer index -> the target's index
in jaxmem.lora.adapters.TARGETS order; the mask keeps each element with probability 1 - p
(jax.random.bernoulli on the input's shape) and scales the kept ones by 1 / (1 - p).
"""
from __future__ import annotations

import dataclasses
import string
from typing import Callable

import jax
import jax.numpy as jnp

from jaxmem.lora.adapters import TARGETS
from jaxmem.lora.frozen import LoraSetup, rebuild as merged_rebuild, rebuild_with
from jaxmem.model.layers import einsum_project

DOMAIN = 0x10AD  # folded into key(train.seed) first: dropout keys never meet the init keys
TARGET_INDEX = {ours: i for i, ours in enumerate(TARGETS.values())}


def step_key(seed: int, step, micro) -> jax.Array:
    """The key of one micro-batch of one step (step: the state's step counter before the update)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DOMAIN), step)
    return jax.random.fold_in(key, micro)


def layer_keys(key: jax.Array, n_layers: int) -> jax.Array:
    """[n_layers] keys, layer i's = fold_in(key, i)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_layers))


def target_key(layer_key: jax.Array, name: str) -> jax.Array:
    return jax.random.fold_in(layer_key, TARGET_INDEX[name])


def drop(key: jax.Array, x: jax.Array, p: float) -> jax.Array:
    """Inverted dropout: each element kept with probability 1 - p and scaled by 1 / (1 - p), in x's dtype."""
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - p, x.dtype), jnp.zeros((), x.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AdaptedWeight:
    """One layer's targeted weight as the projection hook sees it (the model reads it as `w[...]`)."""

    w: jax.Array  # the rebuilt base weight, in the compute dtype
    a: jax.Array  # [*in, r]
    b: jax.Array  # [r, *out]
    key: jax.Array
    scale: float = dataclasses.field(metadata=dict(static=True))
    p: float = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, index):
        return self


def project(spec: str, x: jax.Array, w, compute_dtype) -> jax.Array:
    """The projection hook: a plain weight as the model's default einsum; an AdaptedWeight as
    x W + scale * (drop(x) A) B, the low-rank path in fp32 and the sum cast to the compute dtype."""
    if not isinstance(w, AdaptedWeight):
        return einsum_project(spec, x, w, compute_dtype)
    ins, rest = spec.split(",")
    w_letters, out_letters = rest.split("->")
    n_in = w.a.ndim - 1
    r = next(c for c in string.ascii_letters if c not in spec)
    x_letters = ins
    xa = jnp.einsum(f"{x_letters},{w_letters[:n_in]}{r}->{x_letters[:-n_in]}{r}", drop(w.key, x, w.p),
                    w.a.astype(jnp.float32), preferred_element_type=jnp.float32)
    low = jnp.einsum(f"{x_letters[:-n_in]}{r},{r}{w_letters[n_in:]}->{out_letters}", xa, w.b.astype(jnp.float32),
                     preferred_element_type=jnp.float32)
    y = einsum_project(spec, x, w.w, compute_dtype)
    return (y.astype(jnp.float32) + w.scale * low).astype(compute_dtype)


def with_keys(pieces: dict, key: jax.Array | None, n_layers: int) -> dict:
    """The scan's per-layer LoRA pieces (jaxmem.lora.frozen.lora_layers) with each target's [L] keys added;
    no key (evaluation): unchanged, so the layers take the merged path."""
    if key is None:
        return pieces
    keys = layer_keys(key, n_layers)
    return {name: dict(p, key=jax.vmap(lambda k: target_key(k, name))(keys)) for name, p in pieces.items()}


def rebuild(setup: LoraSetup, shapes: dict[str, tuple[int, ...]], dtype, p: float) -> Callable:
    """Like jaxmem.lora.frozen.rebuild, but a layer whose pieces carry keys gets AdaptedWeights."""
    merged = merged_rebuild(setup, shapes, dtype)
    adapted = rebuild_with(setup, shapes, lambda name, w, piece: AdaptedWeight(
        w.astype(dtype), piece["a"], piece["b"], piece["key"], setup.scale, p))

    def fetch(sliced):
        keyed = any("key" in piece for piece in sliced[1].values())
        return adapted(sliced) if keyed else merged(sliced)

    return fetch
