"""AdamW whose first and second moments are stored block-quantized (jaxmem.optim.codes).

Each step dequantizes m and v, runs optax's own Adam moment and bias-correction arithmetic in fp32, takes the
update from those fp32 values, and requantizes them for storage: one jittable function that XLA fuses per
tensor. So a step's update is the fp32 update of the stored moments; the quantization error enters only
through what is stored for the next step. Vectors (norms, biases: few bytes, and the most sensitive to
rounding) and tensors with fewer than `threshold` values keep fp32 moments (jaxmem.optim.kind.quantizes).

The state is an `optax.ScaleByAdamState` whose mu and nu leaves are `codes.QTensor`s (or fp32 arrays), so
code that looks for Adam's count keeps working, and the state vmaps over a layer stack like optax's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxmem.config.schema import Config
from jaxmem.optim.hyper import decay_mask, schedule
from jaxmem.optim import codes
from jaxmem.optim.kind import quantizes
from jaxmem.optim.states import THRESHOLD, moment_kind


def scale_by_adam_lowbit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, *,
                         moments: str = "int8", block: int | None = None, threshold: int = THRESHOLD
                         ) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with m and v stored in the quantized kind `moments` (jaxmem.optim.states: its codes),
    blocks of `block` values (default: the kind's) along each tensor's last dim; vectors and tensors under
    `threshold` values stay fp32 (kind.quantizes)."""
    kind = moment_kind(moments)
    if not kind.quantized:
        raise ValueError(f"scale_by_adam_lowbit: {moments} moments are not quantized")
    m_code, v_code = kind.codes
    block = block or kind.default_block

    def stored_zeros(p, code):
        if not quantizes(p.shape, threshold):
            return jnp.zeros(p.shape, jnp.float32)
        return codes.zeros(p.shape, code, block)

    def init(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                      mu=jax.tree.map(lambda p: stored_zeros(p, m_code), params),
                                      nu=jax.tree.map(lambda p: stored_zeros(p, v_code), params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, values(state.mu), b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, values(state.nu), b2, 2)
        count_inc = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count_inc)
        nu_hat = optax.tree.bias_correction(nu, b2, count_inc)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        return updates, optax.ScaleByAdamState(count=count_inc, mu=stored_like(state.mu, mu),
                                               nu=stored_like(state.nu, nu))

    return optax.GradientTransformation(init, update)


def values(tree):
    """A moment tree in fp32: quantized leaves dequantized, the others as they are."""
    return jax.tree.map(lambda x: codes.dequantize(x) if codes.is_quantized(x) else x, tree,
                        is_leaf=codes.is_quantized)


def stored_like(old, new):
    """`new` (fp32 values) stored the way `old` is: requantized with old's code and block, or in old's dtype."""
    def store(o, n):
        return codes.quantize(n, o.code, o.block) if codes.is_quantized(o) else n.astype(o.dtype)

    return jax.tree.map(store, old, new, is_leaf=codes.is_quantized)


def make_lowbit_adamw(cfg: Config, moments: str, *, block: int | None = None, threshold: int = THRESHOLD
                      ) -> optax.GradientTransformation:
    """`jaxmem.optim.choice.make_optimizer`'s AdamW (its schedule, betas, eps, decoupled weight decay without
    norms and biases) with m and v in the quantized kind `moments`; the chain and its state's layout are
    optax.adamw's."""
    o = cfg.optimizer
    return optax.chain(scale_by_adam_lowbit(o.b1, o.b2, o.eps, moments=moments, block=block, threshold=threshold),
                       optax.add_decayed_weights(o.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(schedule(cfg)))
