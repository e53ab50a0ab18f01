"""The optimizer update over whole tensors at once, for an update under XLA host compute.

`jaxmem.optim.layerwise.layerwise_update` walks the layer stack with `lax.scan` so that the update's fp32
temporaries are one layer's on the device. On XLA:CPU that loop is what costs: each iteration's
dynamic-update-slice of the stacked state is emitted over the whole stack, and copy insertion adds
whole-stack copies inside the loop, so the update's time grows as layers x stack (benchmarks/host_update.md).
Host memory is not what the scan saves there, so this update runs the per-layer optimizer vmapped over the
stack: each tensor is a handful of elementwise passes, in place where the caller donates the state, and the
global-norm clip is one multiplication folded into those passes.

Same contract as `layerwise_update` for the host path (`jaxmem.core.offload.run_update` calls
`update(grads, opt_state, weights, old_params, scale)` there): no fetch, homes or pieces, since an update on
the host reads and writes where the state lives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.optim import rows
from jaxmem.optim.fused_host import FusedAdamW, fused_update
from jaxmem.optim.layerwise import apply_update, clip_multiplier, clipped, layer_key, split_layers


def _norm_and_finite(grads, scale):
    """The global norm of the unscaled gradients, summed as layerwise_update sums them (each layer's squares,
    the layers' sums, then the non-layer leaves' first), and whether every value is finite."""
    def leaves_of(tree):
        return [x.sums if rows.is_rows(x) else x for x in jax.tree.leaves(tree, is_leaf=rows.is_rows)]

    rest, layers = split_layers(grads)
    rest, layers = leaves_of(rest), leaves_of(layers)
    if not rest + layers:
        return jnp.float32(0.0), jnp.bool_(True)
    unscaled = lambda x: x.astype(jnp.float32) / scale  # noqa: E731
    sq_rest = sum(jnp.sum(jnp.square(unscaled(x))) for x in rest) if rest else jnp.float32(0.0)
    sq_layers = sum(jnp.sum(jnp.square(unscaled(x)), axis=tuple(range(1, x.ndim))) for x in layers)
    finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in rest + layers]).all()
    return jnp.sqrt(sq_rest + jnp.sum(sq_layers)), finite


def _in_space(x, space):
    return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


def _vmapped_layers(opt, g, state, w, param_dtype, round_key=None):
    """The per-layer update vmapped over the stack. The stacked per-layer scalars (Adam's count, [layers], the
    same in every layer since every step updates every layer) go in unbatched, as layer 0's, and come out
    broadcast back: batched, vmap would broadcast optax's constants next to them in device space, which an
    operand in host memory (under host compute) cannot meet."""
    axes = jax.tree.map(lambda x: None if x.ndim == 1 else 0, state)
    first = jax.tree.map(lambda x: x[0] if x.ndim == 1 else x, state)
    n_layers = jax.tree.leaves(w)[0].shape[0]
    keys = None if round_key is None else jax.vmap(lambda i: layer_key(round_key, i))(jnp.arange(n_layers))
    p, new_state, new_w = jax.vmap(lambda g, s, w, k: apply_update(opt, g, s, w, param_dtype, k),
                                   in_axes=(0, axes, 0, 0), out_axes=(0, axes, 0))(g, first, w, keys)
    restack = lambda n, old: _in_space(jnp.broadcast_to(n, old.shape), jax.typeof(old).memory_space)  # noqa: E731
    return p, jax.tree.map(lambda n, old: restack(n, old) if old.ndim == 1 else n, new_state, state), new_w


def whole_update(opt, grads, opt_state, weights, old_params, scale, *, clip_norm: float, param_dtype,
                 skip_nonfinite: bool, norm=None, round_key=None, fused: FusedAdamW | None = None):
    """`layerwise_update`'s step (unscale by `scale`, clip to `clip_norm` by the global norm, AdamW, new params
    in `param_dtype`; with `skip_nonfinite` an inf/nan anywhere keeps every old value) over whole tensors.
    The same arithmetic as layerwise_update's, element by element. `round_key`: the step's
    stochastic-rounding key, folded with each layer's index as layerwise_update folds it (the same bits).
    `fused`: the step through the one-pass host AdamW kernel (jaxmem.optim.fused_host), for the state kind it
    covers; the same step up to the last bits of the fp32 master.
    Returns (new_params, new_opt_state, new_weights, (grad_norm, finite))."""
    own_norm, finite = _norm_and_finite(grads, scale)
    norm = own_norm if norm is None else norm
    finite = finite if skip_nonfinite else jnp.bool_(True)
    if fused is not None:
        new_p, new_s, new_w = fused_update(fused, grads, opt_state, weights, finite,
                                           clip_multiplier(norm, clip_norm, scale))
        return new_p, new_s, new_w, (norm, finite)
    g = rows.densify(clipped(grads, norm, clip_norm, scale))

    g_rest, g_layers = split_layers(g)
    w_rest, w_layers = split_layers(weights)
    n_layers = jax.tree.leaves(w_layers)[0].shape[0]
    p_rest, s_rest, new_w_rest = apply_update(opt, g_rest, opt_state["rest"], w_rest, param_dtype,
                                              layer_key(round_key, n_layers))
    p_layers, s_layers, new_w_layers = _vmapped_layers(opt, g_layers, opt_state["layers"], w_layers, param_dtype,
                                                       round_key)
    new_p, new_s = dict(p_rest, layers=p_layers), {"rest": s_rest, "layers": s_layers}
    new_w = dict(new_w_rest, layers=new_w_layers)
    if skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        old_p = old_params if old_params is not None else jax.tree.map(lambda x: x.astype(param_dtype), weights)
        new_p, new_s, new_w = keep(new_p, old_p), keep(new_s, opt_state), keep(new_w, weights)
    return new_p, new_s, new_w, (norm, finite)
