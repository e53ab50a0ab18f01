"""RMSNorm in plain XLA with a lean backward: the default norm (kernels.norm=xla / auto).

Plain autodiff of `rms_norm_reference` keeps the fp32 upcast of x for the backward (twice x's bytes in
bf16). This custom VJP keeps only x in its own dtype and the weight; the backward recomputes 1/rms from x
(one fused pass over a row it reads anyway) and forms dx and dw in fp32. Numerics equal the reference's
autodiff up to rounding (tests/integration/test_lean_residuals.py); the reference stays the executable spec.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.kernels.rms_norm.reference import rms_norm_reference


def _normalized(x, eps):
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * inv, inv


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm_lean(x, weight, eps):
    return rms_norm_reference(x, weight, eps)


def _fwd(x, weight, eps):
    return rms_norm_reference(x, weight, eps), (x, weight)


def _bwd(eps, residuals, dy):
    x, weight = residuals
    x_hat, inv = _normalized(x, eps)
    dy32 = dy.astype(jnp.float32)
    w_dy = weight.astype(jnp.float32) * dy32
    dx = (w_dy - x_hat * jnp.mean(x_hat * w_dy, axis=-1, keepdims=True)) * inv
    dw = jnp.sum((dy32 * x_hat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_rms_norm_lean.defvjp(_fwd, _bwd)


def rms_norm_lean(x, weight, eps: float = 1e-6):
    """`rms_norm_reference`'s value; its backward keeps x in x's dtype (no fp32 copy) and the weight."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {weight.shape} != last dim of x {x.shape[-1:]}")
    return _rms_norm_lean(x, weight, float(eps))
