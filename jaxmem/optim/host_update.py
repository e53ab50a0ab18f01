"""The optimizer update over whole tensors at once, for an update under XLA host compute.

`jaxmem.core.optim.layerwise_update` walks the layer stack with `lax.scan` so that the update's fp32
temporaries are one layer's on the device. On XLA:CPU that loop is what costs: each iteration's
dynamic-update-slice of the stacked state is emitted over the whole stack, and copy insertion adds
whole-stack copies inside the loop, so the update's time grows as layers x stack (benchmarks/host_update.md).
Host memory is not what the scan saves there, so this update runs the per-layer optimizer vmapped over the
stack: each tensor is a handful of elementwise passes, in place where the caller donates the state, and the
global-norm clip is one scalar factor folded into those passes instead of a clipped copy of the gradients.

Same contract as `layerwise_update` for the host path (`jaxmem.core.offload.run_update` calls
`update(grads, opt_state, weights, old_params, scale)` there): no fetch, homes or pieces, since an update on
the host reads and writes where the state lives.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.core import embed_grad
from jaxmem.core.optim import apply_update, split_layers


def _norm_and_finite(grads, scale):
    leaves = [x.sums if embed_grad.is_rows(x) else x for x in jax.tree.leaves(grads, is_leaf=embed_grad.is_rows)]
    if not leaves:
        return jnp.float32(0.0), jnp.bool_(True)
    square = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
    finite = jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()
    return jnp.sqrt(square) / scale, finite


def _in_space(x, space):
    return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


def _vmapped_layers(opt, g, state, w, param_dtype):
    """The per-layer update vmapped over the stack. The stacked per-layer scalars (Adam's count, [layers], the
    same in every layer since every step updates every layer) go in unbatched, as layer 0's, and come out
    broadcast back: batched, vmap would broadcast optax's constants next to them in device space, which an
    operand in host memory (under host compute) cannot meet."""
    axes = jax.tree.map(lambda x: None if x.ndim == 1 else 0, state)
    first = jax.tree.map(lambda x: x[0] if x.ndim == 1 else x, state)
    p, new_state, new_w = jax.vmap(lambda g, s, w: apply_update(opt, g, s, w, param_dtype),
                                   in_axes=(0, axes, 0), out_axes=(0, axes, 0))(g, first, w)
    restack = lambda n, old: _in_space(jnp.broadcast_to(n, old.shape), jax.typeof(old).memory_space)  # noqa: E731
    return p, jax.tree.map(lambda n, old: restack(n, old) if old.ndim == 1 else n, new_state, state), new_w


def whole_update(opt, grads, opt_state, weights, old_params, scale, *, clip_norm: float, param_dtype,
                 skip_nonfinite: bool, norm=None):
    """`layerwise_update`'s step (unscale by `scale`, clip to `clip_norm` by the global norm, AdamW, new params
    in `param_dtype`; with `skip_nonfinite` an inf/nan anywhere keeps every old value) over whole tensors.
    The clip multiplies by min(1, clip_norm / norm), optax's rule up to the last bit.
    Returns (new_params, new_opt_state, new_weights, (grad_norm, finite))."""
    own_norm, finite = _norm_and_finite(grads, scale)
    norm = own_norm if norm is None else norm
    finite = finite if skip_nonfinite else jnp.bool_(True)
    factor = jnp.float32(1.0) if clip_norm <= 0 else jnp.where(norm < clip_norm, 1.0, clip_norm / norm)
    multiplier = (factor / scale).astype(jnp.float32)
    g = embed_grad.densify(embed_grad.map_values(lambda x: x.astype(jnp.float32) * multiplier, grads))

    g_rest, g_layers = split_layers(g)
    w_rest, w_layers = split_layers(weights)
    p_rest, s_rest, new_w_rest = apply_update(opt, g_rest, opt_state["rest"], w_rest, param_dtype)
    p_layers, s_layers, new_w_layers = _vmapped_layers(opt, g_layers, opt_state["layers"], w_layers, param_dtype)
    new_p, new_s = dict(p_rest, layers=p_layers), {"rest": s_rest, "layers": s_layers}
    new_w = dict(new_w_rest, layers=new_w_layers)
    if skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        old_p = old_params if old_params is not None else jax.tree.map(lambda x: x.astype(param_dtype), weights)
        new_p, new_s, new_w = keep(new_p, old_p), keep(new_s, opt_state), keep(new_w, weights)
    return new_p, new_s, new_w, (norm, finite)
