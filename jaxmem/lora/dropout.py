"""`lora.dropout`: PEFT-style dropout on the adapters' input, y = x W + scale * (drop(x) A) B.

A LoRA run's projections always keep the base path and the low-rank path apart (jaxmem.lora.linear); with
dropout the train step also hands each adapted projection a key and the low-rank path takes drop(x). Only
the train step passes a key; evaluation and merge-lora never drop, and `lora.dropout=0` draws no mask.

Keys, all by jax.random.fold_in, so a step recomputed in the backward (remat) or after a resume draws the
same masks: key(train.seed) -> DOMAIN -> step -> micro-batch index -> layer index -> the target's index
in jaxmem.lora.adapters.TARGETS order (an expert projection: its dense name's); the mask keeps each element
with probability 1 - p (jax.random.bernoulli on the input's shape) and scales the kept ones by 1 / (1 - p).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.lora.adapters import DENSE_OF_EXPERT, TARGETS
from jaxmem.lora.linear import AdaptedWeight, FrozenWeight, drop, project  # noqa: F401 (the hook and its weights)

DOMAIN = 0x10AD  # folded into key(train.seed) first: dropout keys never meet the init keys
TARGET_INDEX = {ours: i for i, ours in enumerate(TARGETS.values())}
TARGET_INDEX.update({expert: TARGET_INDEX[dense] for expert, dense in DENSE_OF_EXPERT.items()})  # same slot


def step_key(seed: int, step, micro) -> jax.Array:
    """The key of one micro-batch of one step (step: the state's step counter before the update)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DOMAIN), step)
    return jax.random.fold_in(key, micro)


def layer_keys(key: jax.Array, n_layers: int) -> jax.Array:
    """[n_layers] keys, layer i's = fold_in(key, i)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_layers))


def target_key(layer_key: jax.Array, name: str) -> jax.Array:
    return jax.random.fold_in(layer_key, TARGET_INDEX[name])


def with_keys(pieces: dict, key: jax.Array | None, n_layers: int) -> dict:
    """The scan's per-layer LoRA pieces (jaxmem.lora.frozen.lora_layers) with each adapted target's [L] keys
    added; no key (evaluation): unchanged, so no mask is drawn."""
    if key is None:
        return pieces
    keys = layer_keys(key, n_layers)
    return {name: dict(p, key=jax.vmap(lambda k: target_key(k, name))(keys)) if "a" in p else p
            for name, p in pieces.items()}
