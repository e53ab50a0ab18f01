"""The run's optimizer (an optax GradientTransformation) from its config: AdamW with its moments in a float
dtype (optax.adamw) or block-quantized (jaxmem.optim.adamw_lowbit), as jaxmem.optim.states' kind says, or Adafactor
(optax.adafactor, jaxmem.optim.adafactor); warmup + cosine decay, decoupled weight decay without norms and
biases. Clipping by the global norm sits outside the chain, in the update (jaxmem.optim.layerwise)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.schema import Config
from jaxmem.optim.adafactor import make_adafactor
from jaxmem.optim.adamw_lowbit import make_lowbit_adamw
from jaxmem.optim.hyper import decay_mask, schedule
from jaxmem.optim.kind import state_kind


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The optimizer `cfg` names (StateKind): AdamW's m and v in precision.moment_dtype, or Adafactor."""
    kind = state_kind(cfg)
    if kind.name == "adafactor":
        return make_adafactor(cfg)
    if kind.quantized:
        return make_lowbit_adamw(cfg, kind.moment, block=kind.block)
    o, dtype = cfg.optimizer, kind.moments.dtype
    adamw = optax.adamw(schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mu_dtype=dtype,
                        mask=decay_mask)
    return moments_in(adamw, dtype)


def moments_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """Keeps Adam's second moment in `dtype` too (optax's mu_dtype only covers the first; its nu takes the
    params' dtype, so bf16 params without a master kept v in bf16 under moment_dtype float32)."""

    def cast(state):
        def fix(s):
            if isinstance(s, optax.ScaleByAdamState):
                return s._replace(nu=jax.tree.map(lambda v: v if v.dtype == dtype else v.astype(dtype), s.nu))
            return s

        return jax.tree.map(fix, state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))

    def init(params):
        return cast(inner.init(params))

    def update(updates, state, params=None):
        new_updates, new_state = inner.update(updates, state, params)
        return new_updates, cast(new_state)

    return optax.GradientTransformation(init, update)
