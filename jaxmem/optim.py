"""AdamW with warmup + cosine decay (optax), and global-norm clipping applied by the step.

Clipping sits outside the optax chain so the same code runs on the device and,
under `compute_on("device_host")`, on the host: optax's norm builds device-space
zeros for the imaginary part, which the host computation cannot mix with host
values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.config import Config
from jaxmem.precision import Precision


def schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optimizer
    decay = o.decay_steps or cfg.train.steps
    warmup = min(o.warmup_steps, max(decay - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(decay, warmup + 1),
        end_value=o.lr * o.min_lr_ratio)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW; m is kept in precision.moment_dtype, v too (see `_moments_in`)."""
    o = cfg.optimizer
    prec = Precision.from_config(cfg.precision)
    adamw = optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                        mu_dtype=prec.moment, mask=_decay_mask)
    return _moments_in(adamw, prec.moment)


def global_norm(tree) -> jax.Array:
    """sqrt of the sum of squares of every leaf, in fp32 (real leaves only)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def clip_by_global_norm(tree, norm: jax.Array, max_norm: float):
    """optax.clip_by_global_norm's rule given the norm: unchanged below max_norm, else rescaled to it."""
    if max_norm <= 0:
        return tree
    return jax.tree.map(lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm), tree)


def _decay_mask(params):
    """No weight decay on norms and biases (1-D per layer)."""

    def keep(path, x):
        last = str(getattr(path[-1], "key", path[-1]))
        return not (last.endswith("norm") or last in ("bq", "bk", "bv"))

    return jax.tree_util.tree_map_with_path(keep, params)


def _moments_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """Keeps Adam's second moment in `dtype` too (optax's mu_dtype only covers the first)."""
    if jnp.dtype(dtype) == jnp.float32:
        return inner

    def cast(state):
        def fix(s):
            if isinstance(s, optax.ScaleByAdamState):
                return s._replace(nu=jax.tree.map(lambda v: v.astype(dtype), s.nu))
            return s

        return jax.tree.map(fix, state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))

    def init(params):
        return cast(inner.init(params))

    def update(updates, state, params=None):
        new_updates, new_state = inner.update(updates, state, params)
        return new_updates, cast(new_state)

    return optax.GradientTransformation(init, update)
