"""Precision policy: storage, compute, master and reduction dtypes; fp16 loss scaling."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmem.config.schema import LossScaleConfig, PrecisionConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    param: jnp.dtype
    compute: jnp.dtype
    grad_reduce: jnp.dtype
    master: bool  # optimizer holds an fp32 copy of params stored in a lower dtype
    stochastic_rounding: bool = False  # the update rounds into the bf16 params stochastically (no master)

    @classmethod
    def from_config(cls, p: PrecisionConfig) -> "Precision":
        master = p.master_weights and p.param_dtype != "float32"
        return cls(DTYPES[p.param_dtype], DTYPES[p.compute_dtype], DTYPES[p.grad_reduce_dtype], master,
                   rounds_stochastically(p))


def rounds_stochastically(p: PrecisionConfig) -> bool:
    """precision.stochastic_rounding as it applies: null means on for bf16 params without an fp32 master."""
    if p.stochastic_rounding is not None:
        return p.stochastic_rounding
    return p.param_dtype == "bfloat16" and not p.master_weights


def init_loss_scale(cfg: LossScaleConfig) -> dict:
    return {"scale": jnp.asarray(cfg.init_scale, jnp.float32), "good_steps": jnp.asarray(0, jnp.int32)}


def all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all()


def update_loss_scale(state: dict, finite: jax.Array, cfg: LossScaleConfig) -> dict:
    """Dynamic loss scaling: back off on overflow, grow after `growth_interval` good steps."""
    good = jnp.where(finite, state["good_steps"] + 1, 0)
    grow = good >= cfg.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state["scale"] * cfg.growth_factor, state["scale"]),
                      jnp.maximum(state["scale"] * cfg.backoff_factor, cfg.min_scale))
    return {"scale": scale, "good_steps": jnp.where(grow, 0, good)}
