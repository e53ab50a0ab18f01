"""The layer-wise optimizer state and its update: clip by the global norm, one optimizer step per layer of the
stack (or over whole tensors: jaxmem.optim.host_update), the new params in their dtype, rounded stochastically
into bf16 params that have no fp32 master.

Clipping and the global norm sit outside the optax chain, in `layerwise_update`, so the same code runs on the
device and, under XLA host compute (`compat.host_compute`), on the host: optax's norm builds device-space zeros
for the imaginary part, which a host computation cannot mix with host values.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from jaxmem.mesh.sharding import spec_ways
from jaxmem.optim import codes, rows
from jaxmem.optim.kind import StateKind
from jaxmem.optim.specs import map_param_subtrees
from jaxmem.optim.stochastic_round import tree_to_bf16
from jaxmem.runtime import compat


def clipped(grads, norm: jax.Array, max_norm: float, scale):
    """The gradients unscaled by `scale` (the loss scale) and clipped by their global `norm` (optax's
    clip_by_global_norm rule: unchanged below max_norm, else rescaled to it; <= 0: no clipping), in fp32: one
    multiplication per value by min(1, max_norm / norm) / scale (cheaper than dividing every value, above all in
    the host's XLA:CPU update). A RowGrad keeps its form."""
    multiplier = clip_multiplier(norm, max_norm, scale)
    return rows.map_values(lambda g: g.astype(jnp.float32) * multiplier, grads)


def clip_multiplier(norm: jax.Array, max_norm: float, scale) -> jax.Array:
    """min(1, max_norm / norm) / scale in fp32: what `clipped` multiplies every gradient value by."""
    factor = jnp.float32(1.0) if max_norm <= 0 else jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return (factor / scale).astype(jnp.float32)



# ---------------------------------------------------------------- layer-wise state and update
# The optimizer state is {"rest": state of the non-layer params, "layers": the per-layer states stacked
# along the layer axis}. The update then walks the layers one at a time (lax.map), so its fp32
# temporaries are one layer's worth wherever it runs, and a host-resident state can be streamed through
# the device a layer at a time.


def init_opt_state(opt: optax.GradientTransformation, weights: dict) -> dict:
    """The layer-wise state of `weights`; a part of a params tree (host_init builds a state piece by piece)
    gets the parts it has: no "layers" entry without a layer stack."""
    rest = {k: v for k, v in weights.items() if k != "layers"}
    state = {"rest": opt.init(rest)}
    if "layers" in weights:
        state["layers"] = jax.vmap(opt.init)(weights["layers"])
    return state


def adam_count(opt_state: dict) -> jax.Array:
    """The optimizer's step count (Adam's, or Adafactor's factored state's) from the non-layer state."""
    counted = (optax.ScaleByAdamState, optax.FactoredState)
    for leaf in jax.tree.leaves(opt_state["rest"], is_leaf=lambda x: isinstance(x, counted)):
        if isinstance(leaf, counted):
            return leaf.count
    return jnp.int32(0)


# The new params must be the rounding of the new weights as stored. From jax 0.12 on, XLA may recompute a weight
# inside its cast's fusion with another contraction (XLA:CPU: an FMA, one bf16 ulp apart where the fp32 value sits
# at a rounding boundary); a barrier on each weight before its cast keeps the two one value. One barrier per leaf:
# one over the whole tree held every new weight of the layer at once (benchmarks/constants.md, optim). jax 0.10
# and 0.11 round the stored value without it, and their programs stay as they were.
_BARRIER_BEFORE_CAST = compat.version_tuple(jax.__version__) >= (0, 12, 0)


def apply_update(opt, g, s, w, param_dtype, round_key=None):
    """One optimizer step of the (clipped, fp32) gradient g on weights w with state s:
    (new params in param_dtype, new state, new weights). With `round_key` (bf16 weights without an fp32
    master, precision.stochastic_rounding) the new weights are rounded stochastically into bf16, leaf i with
    fold_in(round_key, i), instead of to the nearest bf16."""
    updates, new_s = opt.update(g, s, w)
    if round_key is not None:
        new_w = tree_to_bf16(jax.tree.map(lambda x, u: x.astype(jnp.float32) + u, w, updates), round_key)
        return new_w, new_s, new_w
    new_w = optax.apply_updates(w, updates)
    if _BARRIER_BEFORE_CAST:
        new_w = jax.tree.map(jax.lax.optimization_barrier, new_w)
    return jax.tree.map(lambda x: x.astype(param_dtype), new_w), new_s, new_w


def layer_key(round_key, index):
    """The rounding key of layer `index` of the stack (the non-layer leaves take the stack's length), or None."""
    return None if round_key is None else jax.random.fold_in(round_key, index)


def _same_space(x, like):
    """x in like's memory space (optax builds some scalars, e.g. Adam's count, from device constants)."""
    space = jax.typeof(like).memory_space
    return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


def split_layers(tree):
    """(everything but the layer stack, the layer stack) of a params-shaped tree."""
    return {k: v for k, v in tree.items() if k != "layers"}, tree["layers"]


def take_layer(stacked, i):
    """Layer i of a stacked (leading layer axis) tree."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), stacked)


def put_layer(stacked, new, i):
    """`stacked` with layer i replaced by `new`, in the stack's dtype and memory space (in place in a loop
    carry)."""
    return jax.tree.map(lambda a, n: jax.lax.dynamic_update_index_in_dim(a, _same_space(n.astype(a.dtype), a), i, 0),
                        stacked, new)


def put_slice(whole, part, start, axis: int):
    """`whole` with [start, start + part's length) along `axis` replaced by `part`, in whole's dtype and memory
    space (in place in a loop carry)."""
    return jax.lax.dynamic_update_slice_in_dim(whole, _same_space(part.astype(whole.dtype), whole), start, axis)


# The most fp32 bytes per device of one leaf's chunk where a large non-layer leaf (the embedding, the LM head) is
# handled in pieces: its host state built at init (jaxmem.core.host_init) and streamed through the update.
CHUNK_BYTES = 256 * 2**20


def chunking(shape: tuple, spec, limit: int, shards: int = 1) -> tuple[int, int]:
    """(axis, count) to handle a leaf of `shape` split by partition `spec` (`shards` devices hold a piece
    each) in `count` equal pieces along `axis`: the first axis the spec leaves whole (pieces along a split axis
    would gather it) and the fewest pieces, a power of two dividing that axis, of at most `limit` fp32 bytes
    per device. (0, 1) for a leaf that needs no pieces or has no whole axis."""
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    whole = [i for i, part in enumerate(spec) if part is None]
    if not whole:
        return 0, 1
    axis, count, per_device = whole[0], 1, 4 * math.prod(shape) // shards
    while per_device > count * limit and shape[axis] % (2 * count) == 0:
        count *= 2
    return axis, count


def rest_chunks(abstract_rest: dict, rest_specs: list, mesh_sizes: dict, limit: int | None = None,
                kind: StateKind | None = None):
    """(axes, count) for `layerwise_update(rest_chunks=)`: every non-layer leaf cut in `count` pieces along its
    `axes` leaf, count the largest any leaf needs under `limit` (CHUNK_BYTES by default). `rest_specs`: each
    leaf's partition spec, in leaf order; `mesh_sizes`: devices per mesh axis. None where no leaf needs pieces
    or some leaf cannot be cut so (its whole axis does not divide by count, or its optimizer state `kind`
    cannot be cut there: StateKind.cuts)."""
    limit = CHUNK_BYTES if limit is None else limit
    leaves, treedef = jax.tree.flatten(abstract_rest)
    plans = [chunking(x.shape, spec, limit, spec_ways(spec, mesh_sizes)) if x.ndim else (0, 1)
             for x, spec in zip(leaves, rest_specs, strict=True)]
    count = max((c for _, c in plans), default=1)
    if count == 1 or not all(x.ndim and x.shape[axis] % count == 0 for x, (axis, _) in zip(leaves, plans)):
        return None
    if kind is not None and not all(kind.cuts(x.shape, axis, count) for x, (axis, _) in zip(leaves, plans)):
        return None
    return treedef.unflatten([axis for axis, _ in plans]), count


def state_axes(state, weights, axes):
    """Each leaf of the optimizer `state` of `weights` cut along its weight's axis in `axes` (a tree shaped like
    the weights): the param-shaped leaves (Adam's m and v, a QTensor's codes and scales) along that axis, every
    other leaf (counts) -1, kept whole."""
    weights_def = jax.tree.structure(weights)

    def leaf(axis, w, x):
        if codes.is_quantized(x):
            return dataclasses.replace(x, codes=axis, scales=axis)
        return axis if tuple(x.shape) == tuple(w.shape) else -1

    return map_param_subtrees(state, weights_def,
                              lambda node: jax.tree.map(leaf, axes, weights, node, is_leaf=codes.is_quantized),
                              lambda node: jax.tree.map(lambda _: -1, node))


def _rest_in_chunks(one, chunks, g, s, w, p_old, home, param_dtype, round_key):
    """`one` over the non-layer leaves a piece at a time (chunks = rest_chunks(...)): each leaf's state, weights
    and gradient sliced along its axis, updated, and written back in place, so a host-resident state streams
    through the device a piece at a time instead of whole (the embedding's fp32 master, m and v). Piece i
    rounds with layer_key(round_key, i)."""
    axes, count = chunks
    s_axes = state_axes(s, w, axes)
    size = lambda x, axis: x.shape[axis] // count  # noqa: E731
    take = lambda x, axis, i: x if axis < 0 else jax.lax.dynamic_slice_in_dim(  # noqa: E731
        x, i * size(x, axis), size(x, axis), axis)
    put = lambda x, part, axis, i: x if axis < 0 else put_slice(x, part, i * size(x, axis), axis)  # noqa: E731

    def grad_piece(x, axis, i):  # an embedding's rows (jaxmem.optim.rows; never with host layers) widened whole
        return take(rows.dense(x) if rows.is_rows(x) else x, axis, i)

    def body(carry, i):
        s_all, w_all, p_all = carry
        g_i = jax.tree.map(lambda x, axis: grad_piece(x, axis, i), g, axes, is_leaf=rows.is_rows)
        new_p, new_s, new_w = one(g_i, jax.tree.map(lambda x, a: take(x, a, i), s_all, s_axes),
                                  jax.tree.map(lambda x, a: take(x, a, i), w_all, axes),
                                  None if p_old is None else jax.tree.map(lambda x, a: take(x, a, i), p_all, axes),
                                  home, layer_key(round_key, i))
        scalars = [n for n, a in zip(jax.tree.leaves(new_s), jax.tree.leaves(s_axes), strict=True) if a < 0]
        return (jax.tree.map(lambda x, n, a: put(x, n, a, i), s_all, new_s, s_axes),
                jax.tree.map(lambda x, n, a: put(x, n, a, i), w_all, new_w, axes),
                jax.tree.map(lambda x, n, a: put(x, n, a, i), p_all, new_p, axes)), scalars

    # the new params are written over the old ones in place (without old params, an update that makes its own,
    # into zeros); stacked out of the loop or written into fresh zeros, they took more at the backward's peak
    # (benchmarks/constants.md, optim)
    p_all = p_old if p_old is not None else jax.tree.map(lambda x: jnp.zeros(x.shape, param_dtype), w)
    (new_s, new_w, new_p), scalars = jax.lax.scan(body, (s, w, p_all), jnp.arange(count))
    leaves, treedef = jax.tree.flatten(new_s)
    last = iter(x[-1] for x in scalars)
    new_s = treedef.unflatten([next(last) if a < 0 else x for x, a in zip(leaves, jax.tree.leaves(s_axes))])
    return new_p, new_s, new_w


def layerwise_update(opt, grads, opt_state, weights, old_params, scale, *, clip_norm: float, param_dtype,
                     skip_nonfinite: bool, fetch=lambda t: t, homes=None, norm=None, rest_chunks=None,
                     round_key=None):
    """The optimizer over the layers one at a time, then over the non-layer params.

    grads are unscaled by `scale`, clipped by their global norm (optax's rule), and with
    `skip_nonfinite` an inf/nan anywhere keeps every old value. `fetch(tree)` brings a slice to where the
    math runs; `homes[part]` = (params, opt, weights) functions put the results of part "rest" or "layers"
    back where that state lives. `norm`: the global gradient norm when these grads are one part of the model's
    (a pipeline stage's), else it is computed here. `rest_chunks` (optim.rest_chunks): the non-layer leaves are
    updated a piece at a time (a host-resident state streamed through the device). `round_key`: the step's
    stochastic-rounding key (bf16 weights without a master), folded with each layer's index (layer_key; the
    non-layer leaves take the stack's length).
    Returns (new_params, new_opt_state, new_weights, (grad_norm, finite)).
    """
    same = (lambda t: t,) * 3
    homes = homes or {"rest": same, "layers": same}
    g_rest, g_layers = split_layers(grads)

    def unscaled(g):  # fp32 values over the loss scale; an embedding's RowGrad keeps its form
        return rows.map_values(lambda x: x.astype(jnp.float32) / scale, g)

    def sums(g):
        g = unscaled(fetch(g))
        leaves = [x.sums if rows.is_rows(x) else x for x in jax.tree.leaves(g, is_leaf=rows.is_rows)]
        if not leaves:  # LoRA: no trainable weights outside the layers
            return jnp.float32(0.0), jnp.bool_(True)
        return sum(jnp.sum(jnp.square(x)) for x in leaves), jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()

    if norm is None:
        sq_rest, ok_rest = sums(g_rest)
        sq_layers, ok_layers = jax.lax.map(sums, g_layers)
        norm = jnp.sqrt(sq_rest + jnp.sum(sq_layers))
        finite = jnp.logical_and(ok_rest, jnp.all(ok_layers)) if skip_nonfinite else jnp.bool_(True)
    elif skip_nonfinite:
        raise ValueError("layerwise_update: skip_nonfinite needs the norm computed here")
    else:
        finite = jnp.bool_(True)

    def one(g, s, w, p_old, home, key):
        g, s, w, p_old = fetch((g, s, w, p_old))
        g = rows.densify(clipped(g, norm, clip_norm, scale))
        new_p, new_s, new_w = apply_update(opt, g, s, w, param_dtype, key)
        if skip_nonfinite:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
            new_p, new_s, new_w = keep(new_p, p_old), keep(new_s, s), keep(new_w, w)
        return home[0](new_p), home[1](new_s), home[2](new_w)

    w_rest, w_layers = split_layers(weights)
    p_rest, p_layers = split_layers(old_params) if old_params is not None else (None, None)

    # State, weights and (given) params are the loop carry, updated in place one layer at a time (they are
    # donated), so the update's temporaries are one layer's; without old params the new ones are the scan's
    # stacked output.
    def layer(carry, _):
        i, s_all, w_all, p_all = carry
        p, s, w = one(*(take_layer(t, i) for t in (g_layers, s_all, w_all, p_all)), homes["layers"],
                      layer_key(round_key, i))
        s_all, w_all = put_layer(s_all, s, i), put_layer(w_all, w, i)
        if p_all is None:
            return (i + 1, s_all, w_all, None), p
        return (i + 1, s_all, w_all, put_layer(p_all, p, i)), None

    n_layers = jax.tree.leaves(w_layers)[0].shape[0]
    (done, ls, lw, lp), stacked = jax.lax.scan(layer, (jnp.int32(0), opt_state["layers"], w_layers, p_layers),
                                               None, length=n_layers)
    lp = stacked if p_layers is None else lp
    # Then the embedding, final norm and LM head, once the layers' gradients are dead (the barrier orders it):
    # the largest of them is widened to its full fp32 shape only here.
    _, g_rest = jax.lax.optimization_barrier((done, g_rest))
    rest_key = layer_key(round_key, n_layers)
    if rest_chunks is None:
        new_p, new_s, new_w = one(g_rest, opt_state["rest"], w_rest, p_rest, homes["rest"], rest_key)
    else:
        new_p, new_s, new_w = _rest_in_chunks(one, rest_chunks, g_rest, opt_state["rest"], w_rest, p_rest,
                                              homes["rest"], param_dtype, rest_key)
    return (dict(new_p, layers=lp), {"rest": new_s, "layers": ls}, dict(new_w, layers=lw), (norm, finite))
