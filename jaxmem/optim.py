"""AdamW with warmup + cosine decay and global-norm clipping (optax)."""
from __future__ import annotations

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
    o = cfg.optimizer
    prec = Precision.from_config(cfg.precision)
    chain = []
    if o.clip_norm > 0:
        chain.append(optax.clip_by_global_norm(o.clip_norm))
    chain.append(optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                             mu_dtype=prec.moment, mask=_decay_mask))
    return optax.chain(*chain)


def _decay_mask(params):
    """No weight decay on norms and biases (1-D per layer)."""
    import jax

    def keep(path, x):
        last = str(getattr(path[-1], "key", path[-1]))
        return not (last.endswith("norm") or last in ("bq", "bk", "bv"))

    return jax.tree_util.tree_map_with_path(keep, params)
