"""Sequence tiling: a per-token part of a layer run over tiles of the sequence, each tile recomputed in the
backward, so the part's intermediates (the [T, d_ff] MLP activations, fp32 norm inputs) exist for one tile
at a time instead of the whole sequence. The model says which parts are per-token
(`ForwardContext.per_token`); this module decides how they run (`remat.seq_tile`).

With sequence parallelism the sequence is split over `sp` devices; a tile is `tile` tokens on every one of
them (a global tile is `sp` local slices), so no tile crosses a device.
"""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxmem.model.names import CheckpointName as CN

# Checkpoint names computed inside a tile and not tagged again outside: a remat policy cannot keep them
# (they are recomputed tile by tile). q, k and v are tagged again whole and follow the policy.
INSIDE_TILES = tuple(n.value for n in (CN.ATTN_NORM, CN.ATTN_OUT, CN.MLP_NORM, CN.MLP_GATE, CN.MLP_UP,
                                       CN.MLP_ACT, CN.MLP_OUT))


def run_whole(fn: Callable, *args, names: Sequence[str] = ()):
    """The untiled default: fn(*args), whose own checkpoint tags stand."""
    return fn(*args)


def tile_count(seq_len: int, sp: int, tile: int) -> int:
    """Tiles per device (1: tiling is off or the sequence is one tile)."""
    if tile <= 0 or seq_len // sp <= tile:
        return 1
    return (seq_len // sp) // tile


def per_token_tiles(tile: int, sp: int = 1) -> Callable:
    """run(fn, *args, names=()) -> fn's outputs, computed tile by tile.

    Every arg and output is [B, T, ...] with the token dim second. `names` are checkpoint names for the
    outputs: inside a tile nothing is saved (a remat policy cannot see in), so an output the policy may
    keep (q, k, v) is tagged again whole, outside the tiles.
    """
    if tile <= 0:
        return run_whole

    def run(fn: Callable, *args, names: Sequence[str] = ()):
        b, t = args[0].shape[:2]
        n = tile_count(t, sp, tile)
        if n == 1:
            return fn(*args)

        def split(x):  # [B, T, ...] -> [n, B, sp * tile, ...]: tile i holds tile i of every device's slice
            rest = x.shape[2:]
            x = jnp.moveaxis(x.reshape(b, sp, n, tile, *rest), 2, 0)
            return x.reshape(n, b, sp * tile, *rest)

        def merge(y):  # the inverse of split
            rest = y.shape[3:]
            return jnp.moveaxis(y.reshape(n, b, sp, tile, *rest), 0, 2).reshape(b, t, *rest)

        body = jax.checkpoint(lambda xs: fn(*xs), policy=jax.checkpoint_policies.nothing_saveable,
                              prevent_cse=False)
        out = jax.tree.map(merge, jax.lax.map(body, tuple(split(a) for a in args)))
        if names:
            out = tuple(checkpoint_name(o, name) for o, name in zip(out, names, strict=True))
        return out

    return run
