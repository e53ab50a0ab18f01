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
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxmem.config.names import CheckpointName as CN

# Checkpoint names computed inside a tile and not tagged again outside: a remat policy cannot keep them
# (they are recomputed tile by tile). q, k and v are tagged again whole and follow the policy.
INSIDE_TILES = tuple(n.value for n in (CN.ATTN_NORM, CN.ATTN_OUT, CN.MLP_NORM, CN.MLP_GATE, CN.MLP_UP,
                                       CN.MLP_ACT, CN.MLP_OUT, CN.ROUTER_LOGITS, CN.MOE_DISPATCH, CN.EXPERT_GATE,
                                       CN.EXPERT_UP, CN.EXPERT_ACT, CN.EXPERT_OUT))


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

    The tiles write into one buffer per output (no stacked [n, ...] copy, no zero buffer that XLA shares
    between loops and copies for each); the backward recomputes each tile and writes each input's cotangent over the
    output cotangent of the same size, read tile by tile before it is overwritten (`_tiled_vjp`).
    """
    if tile <= 0:
        return run_whole

    def run(fn: Callable, *args, names: Sequence[str] = ()):
        b, t = args[0].shape[:2]
        n = tile_count(t, sp, tile)
        if n == 1:
            return fn(*args)
        tiles, single = _Tiles(b, t, sp, n, tile), []

        def tuple_fn(*xs):
            ys = fn(*xs)
            single.append(not isinstance(ys, (tuple, list)))
            return (ys,) if single[-1] else tuple(ys)

        closed, consts = _hoist_consts(tuple_fn, *(tiles.get(tiles.view(a), 0) for a in args))
        out = _tiled_vjp(closed, tiles, len(args))(*args, *consts)
        if single[0]:
            out = out[0]
        if names:
            out = tuple(checkpoint_name(o, name) for o, name in zip(out, names, strict=True))
        return out

    return run


def _hoist_consts(fn: Callable, *example):
    """(fn as a function of (*args, *consts), consts): every value fn closes over becomes an argument, integer
    ones too (jax.closure_convert hoists only floating-point values and leaves an integer one, a QLoRA layer's
    nf4 codes, as a tracer of the enclosing trace inside the jaxpr, which then cannot be lowered)."""
    closed = jax.make_jaxpr(fn)(*example)
    n = len(example)
    return (lambda *xs: tuple(jax.core.eval_jaxpr(closed.jaxpr, xs[n:], *xs[:n]))), list(closed.consts)


class _Tiles:
    """[B, T, ...] seen as [B, sp, n, tile, ...]: tile i is tile i of every device's slice."""

    def __init__(self, b, t, sp, n, tile):
        self.b, self.t, self.sp, self.n, self.tile = b, t, sp, n, tile

    def view(self, x):
        return x.reshape(self.b, self.sp, self.n, self.tile, *x.shape[2:])

    def whole(self, x):
        return x.reshape(self.b, self.t, *x.shape[4:])

    def get(self, v, i, rest=None):  # tile i of a view as [B, sp * tile, ...] (`rest`: its trailing shape)
        y = jax.lax.dynamic_index_in_dim(v, i, axis=2, keepdims=False)
        return y.reshape(self.b, self.sp * self.tile, *(y.shape[3:] if rest is None else rest))

    def put(self, buf, y, i):
        return jax.lax.dynamic_update_index_in_dim(buf, y.reshape(buf.shape[:2] + (1,) + buf.shape[3:]), i, 2)

    def fresh(self, src, x, k: int):
        """A [B, sp, n, tile, ...] buffer for x's values (every tile is overwritten), derived from tile 0 of the
        view `src` and the number k: so XLA neither merges it with another loop's buffer (one shared zero
        buffer and a copy per loop) nor loses src's sharding of the batch and sequence dims."""
        seed = jax.lax.slice_in_dim(src, 0, 1, axis=2)
        seed = jnp.sum(seed * 0, axis=tuple(range(4, src.ndim))) + k if src.ndim > 4 else seed * 0 + k
        rest = x.shape[2:]
        seed = seed.reshape(*seed.shape, *[1] * len(rest)).astype(x.dtype)
        return jnp.broadcast_to(seed, (self.b, self.sp, self.n, self.tile, *rest))


def _float0(x):
    return jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_


def _tiled_vjp(closed: Callable, tiles: _Tiles, n_args: int) -> Callable:
    """closed(*tile_args, *consts) run over tiles, with a backward that recomputes one tile at a time."""

    def forward(*xs):
        args, consts = xs[:n_args], xs[n_args:]
        views = [tiles.view(a) for a in args]
        shapes = jax.eval_shape(closed, *(tiles.get(v, 0) for v in views), *consts)

        def body(i, bufs):
            ys = closed(*(tiles.get(v, i) for v in views), *consts)
            return tuple(tiles.put(buf, y, i) for buf, y in zip(bufs, ys))

        full = [jax.ShapeDtypeStruct((tiles.b, tiles.t) + s.shape[2:], s.dtype) for s in shapes]
        bufs = jax.lax.fori_loop(0, tiles.n, body, tuple(tiles.fresh(views[0], s, k) for k, s in enumerate(full)))
        return tuple(tiles.whole(buf) for buf in bufs)

    def backward(xs, cts):
        args, consts = xs[:n_args], xs[n_args:]
        # each differentiable input's cotangent goes over an output cotangent of the same size and dtype
        free, over = list(range(len(cts))), {}
        for j, a in enumerate(args):
            k = next((k for k in free if not _float0(a) and cts[k].dtype == a.dtype and cts[k].shape[:2]
                      == a.shape[:2] and cts[k].size == a.size), None)
            if k is not None:
                free.remove(k)
                over[j] = k
        diff = [j for j, a in enumerate(args) if not _float0(a)]
        cidx = [c for c, x in enumerate(consts) if not _float0(x)]
        views = [tiles.view(a) for a in args]
        own = {j: tiles.fresh(views[j], args[j], j) for j in diff if j not in over}
        dconsts0 = tuple(jnp.zeros_like(consts[c]) for c in cidx)

        def body(step, carry):
            ct_bufs, own_bufs, dconsts = carry
            i = tiles.n - 1 - step  # the order of lax.map's transpose: the same sums
            tile_args = [tiles.get(v, i) for v in views]
            tile_cts = tuple(tiles.get(c, i, ct.shape[2:]) for c, ct in zip(ct_bufs, cts))
            diff_fn = lambda da, dc: closed(*_merge(tile_args, diff, da), *_merge(consts, cidx, dc))  # noqa: E731
            _, vjp = jax.vjp(diff_fn, [tile_args[j] for j in diff], [consts[c] for c in cidx])
            da, dc = vjp(tile_cts)
            ct_bufs, own_bufs = list(ct_bufs), dict(own_bufs)
            for j, d in zip(diff, da):
                if j in over:
                    ct_bufs[over[j]] = tiles.put(ct_bufs[over[j]], d, i)
                else:
                    own_bufs[j] = tiles.put(own_bufs[j], d, i)
            return tuple(ct_bufs), own_bufs, tuple(a + d for a, d in zip(dconsts, dc))

        ct_views = tuple(tiles.view(c) for c in cts)
        ct_bufs, own_bufs, dconsts = jax.lax.fori_loop(0, tiles.n, body, (ct_views, own, dconsts0))
        dargs = [_zero(a) for a in args]
        for j in diff:
            d = ct_bufs[over[j]] if j in over else own_bufs[j]
            dargs[j] = d.reshape(args[j].shape)
        dcs = [_zero(c) for c in consts]
        for c, d in zip(cidx, dconsts):
            dcs[c] = d
        return (*dargs, *dcs)

    f = jax.custom_vjp(forward)
    f.defvjp(lambda *xs: (forward(*xs), xs), backward)
    return f


def _merge(values, idx, new):
    out = list(values)
    for j, v in zip(idx, new):
        out[j] = v
    return out


def _zero(x):
    return np.zeros(x.shape, jax.dtypes.float0) if _float0(x) else jnp.zeros_like(x)
