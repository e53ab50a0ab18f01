"""Adafactor (optax.adafactor: factored second moment, no first moment) in make_optimizer's shape."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.schema import Config
from jaxmem.optim.hyper import decay_mask, schedule


def make_adafactor(cfg: Config, *, decay_rate: float = 0.8, clipping_threshold: float | None = 1.0,
                   momentum: float | None = None) -> optax.GradientTransformation:
    """optax.adafactor on `cfg.optimizer`'s schedule with its decoupled weight decay (norms and biases not
    decayed). `optimizer.lr` keeps AdamW's absolute meaning: the update is not multiplied by the parameter's
    RMS (optax's multiply_by_parameter_scale is off), and the decay is lr(t) * weight_decay * w like AdamW's,
    where optax.adafactor adds its rate unscaled by the learning rate. b1, b2 and eps are Adam's and unused."""
    o = cfg.optimizer
    lr = schedule(cfg)
    decay = (lambda step: lr(step) * o.weight_decay) if o.weight_decay else None
    inner = optax.adafactor(learning_rate=lr, decay_rate=decay_rate, clipping_threshold=clipping_threshold,
                            multiply_by_parameter_scale=False, momentum=momentum, weight_decay_rate=decay,
                            weight_decay_mask=decay_mask)
    return _state_in_fp32(inner)


def _state_in_fp32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """optax.adafactor keeps its statistics in the params' dtype: bf16 params without a master would get bf16
    factors (and a first update that widens them to fp32). Initialized from fp32 stand-ins they are fp32."""
    def init(params):
        return inner.init(jax.tree.map(lambda p: p.astype(jnp.float32), params))

    return optax.GradientTransformation(init, inner.update)
