"""One AdamW step over a tensor on the host CPU in one pass (host_adamw.cc through XLA's FFI), beside its
pure-jnp reference.

`host_adamw` reads the gradient, the fp32 master weights and the fp32 moments once and writes the master and
the moments in place (aliased: the caller donates them) and the bf16 params; XLA:CPU's own code for the same
step writes each output from a loop of its own (benchmarks/host_update.md). It runs on the host CPU: in a CPU
program, or in a GPU program's host computation (compute_on). The library is built for the machine's CPU on
first use and registered with jaxlib's CPU FFI, or with the CUDA plugin's (jaxmem.kernels.host_adamw.build).

`host_adamw_lowbit` is the same step with m and v block-quantized (codes and per-block scales, the layout of
jaxmem.optim.codes): each block is dequantized, updated and requantized from a block-sized buffer.

`scalars` is f32[5]: [lr, 1 - b1^t, 1 - b2^t, multiplier, skip]. The multiplier (the global-norm clip over the
loss scale) scales every gradient value first; skip != 0 keeps the weights and moments and writes the params
as the old weights rounded (a non-finite fp16 step).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.kernels.host_adamw.build import LOWBIT_TARGET, BuildError, register

__all__ = ["BuildError", "host_adamw", "host_adamw_lowbit", "host_adamw_reference", "lowbit_tables", "register"]


def host_adamw(grad, weights, mu, nu, scalars, *, b1: float, b2: float, eps: float, decay: float):
    """(new weights, new mu, new nu, new bf16 params); grad float32 or bfloat16, the rest float32."""
    target = register()
    f32 = jax.ShapeDtypeStruct(weights.shape, jnp.float32)
    call = jax.ffi.ffi_call(target, (f32, f32, f32, jax.ShapeDtypeStruct(weights.shape, jnp.bfloat16)),
                            input_output_aliases={1: 0, 2: 1, 3: 2})
    # 1 - b1 and 1 - b2 rounded from double, as optax's (1 - decay) * g is
    return call(grad, weights, mu, nu, scalars, b1=np.float32(b1), one_minus_b1=np.float32(1.0 - b1),
                b2=np.float32(b2), one_minus_b2=np.float32(1.0 - b2), eps=np.float32(eps), decay=np.float32(decay))


def lowbit_tables(m_code, v_code) -> tuple:
    """host_adamw_lowbit's `tables` for m's and v's codes (jaxmem.optim.codes.Code): each one's values, padded
    midpoints and buckets."""
    return tuple(jnp.asarray(t) for c in (m_code, v_code) for t in (c.table, c.padded_midpoints, c.buckets))


def host_adamw_lowbit(grad, weights, m_codes, m_scales, v_codes, v_scales, scalars, tables, *, bits: int,
                      length: int, v_sqrt_linear: bool, b1: float, b2: float, eps: float, decay: float):
    """host_adamw with m and v block-quantized (jaxmem.optim.codes' layout: uint8 codes, 4-bit ones paired along
    the last dim, fp32 scales [rows, blocks] of `length` values): (new weights, m codes, m scales, v codes,
    v scales, bf16 params). `tables`: (m's values, padded midpoints and buckets, v's likewise): float32,
    float32, uint16 (jaxmem.optim.codes.Code's table, padded_midpoints, buckets). Its
    reference is codes.dequantize, host_adamw_reference and codes.quantize in turn (tests/unit)."""
    register()
    like = lambda x, dtype=None: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype)  # noqa: E731
    outs = (like(weights, jnp.float32), like(m_codes), like(m_scales), like(v_codes), like(v_scales),
            like(weights, jnp.bfloat16))
    call = jax.ffi.ffi_call(LOWBIT_TARGET, outs, input_output_aliases={1: 0, 2: 1, 3: 2, 4: 3, 5: 4})
    return call(grad, weights, m_codes, m_scales, v_codes, v_scales, scalars, *tables, b1=np.float32(b1),
                one_minus_b1=np.float32(1.0 - b1), b2=np.float32(b2), one_minus_b2=np.float32(1.0 - b2),
                eps=np.float32(eps), decay=np.float32(decay), bits=np.int64(bits),
                v_sqrt_linear=np.int64(v_sqrt_linear), length=np.int64(length))


def host_adamw_reference(grad, weights, mu, nu, scalars, *, b1: float, b2: float, eps: float, decay: float):
    """The kernel's arithmetic in jnp, operation for operation (the executable spec its tests compare with)."""
    lr, bc1, bc2, multiplier, skip = (scalars[i] for i in range(5))
    g = grad.astype(jnp.float32) * multiplier
    m = (1.0 - b1) * g + b1 * mu
    v = (1.0 - b2) * (g * g) + b2 * nu
    u = (m * (1.0 / bc1)) / (jnp.sqrt(v * (1.0 / bc2)) + eps) + decay * weights
    w = weights - lr * u
    keep = skip != 0
    w, m, v = (jnp.where(keep, old, new) for old, new in ((weights, w), (mu, m), (nu, v)))
    return w, m, v, w.astype(jnp.bfloat16)
