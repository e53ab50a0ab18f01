"""jaxmem.core.quant's schemes in numpy, on the host, one layer at a time (jaxmem.lora.load_base).

Bit-identical to the jnp quantizers: every step is an elementwise IEEE op or a max, which round the same
everywhere (values times the reciprocal scale, as quant.py spells it), and the one float sum (the mean of a
layer's block absmaxes under double quantization) adds in the fixed pairwise order of quant.pairwise_mean
(tests/integration/test_lora_load_base.py compares the forms bit for bit).
"""
from __future__ import annotations

import numpy as np

from jaxmem.core.quant import INT8_MAX, INV_INT8_MAX, NF4_CODES, SCALE_BLOCK

_CODES = [np.float32(c) for c in NF4_CODES]
CHUNK = 1 << 16  # elements quantized at a time (temporaries: about ten times that in bytes)


def _inverse(scale: np.ndarray) -> np.ndarray:
    """As quant._inverse: 1 / scale, 1 where scale is 0."""
    return np.float32(1) / np.where(scale == 0, np.float32(1), scale)


def quantize_int8(w: np.ndarray, in_axes: tuple[int, ...]) -> dict:
    """As quant.quantize_int8, for a numpy weight whose input axes lead (our layout); computed a few output
    channels at a time, so the temporaries stay a fraction of the weight."""
    in_axes = tuple(a % w.ndim for a in in_axes)
    if in_axes != tuple(range(len(in_axes))):
        raise ValueError(f"int8 on the host wants the input axes first, got {in_axes}")
    out_shape = w.shape[len(in_axes):]
    w2 = w.reshape(-1, int(np.prod(out_shape, dtype=np.int64)))  # [inputs, channels], a view
    q = np.empty(w2.shape, np.int8)
    scale = np.empty((1, w2.shape[1]), np.float32)
    step = max(1, CHUNK // max(w2.shape[0], 1))
    for c in range(0, w2.shape[1], step):
        part = w2[:, c:c + step].astype(np.float32)
        scale[:, c:c + step] = np.max(np.abs(part), axis=0, keepdims=True) * INV_INT8_MAX
        q[:, c:c + step] = np.clip(np.round(part * _inverse(scale[:, c:c + step])), -INT8_MAX, INT8_MAX)
    return {"q": q.reshape(w.shape), "scale": scale.reshape((1,) * len(in_axes) + out_shape)}


def nearest_nf4(x: np.ndarray) -> np.ndarray:
    """As quant.nearest_nf4: the nearest code's index, a tie to the lower code."""
    best = np.zeros(x.shape, np.uint8)
    best_distance = np.abs(x - _CODES[0])
    for i, code in enumerate(_CODES[1:], start=1):
        distance = np.abs(x - code)
        closer = distance < best_distance
        best[closer] = i
        best_distance = np.where(closer, distance, best_distance)
    return best


def quantize_nf4(w: np.ndarray, block: int = 64, double_quant: bool = False) -> dict:
    """As quant.quantize_nf4 with batch_dims=0: one layer's weight, flattened, in blocks of `block`; computed
    CHUNK elements at a time (blocks are independent), so the temporaries stay a fraction of the weight."""
    flat = w.reshape(-1)
    n_blocks = -(-flat.size // block)
    codes = np.empty(n_blocks * block // 2, np.uint8)
    absmax = np.empty(n_blocks, np.float32)
    rows = max(1, CHUNK // block)
    for b in range(0, n_blocks, rows):
        part = flat[b * block:(b + rows) * block].astype(np.float32)
        if part.size % block:  # the last block, padded with zeros
            part = np.concatenate([part, np.zeros(-part.size % block, np.float32)])
        blocks = part.reshape(-1, block)
        absmax[b:b + rows] = np.max(np.abs(blocks), axis=-1)
        indices = nearest_nf4(blocks * _inverse(absmax[b:b + rows])[:, None]).reshape(-1)
        codes[b * block // 2:(b + rows) * block // 2] = indices[0::2] | (indices[1::2] << 4).astype(np.uint8)
    if not double_quant:
        return {"codes": codes, "absmax": absmax}
    return {"codes": codes, **_quantize_scales(absmax)}


def pairwise_mean(x: np.ndarray) -> np.ndarray:
    """As quant.pairwise_mean, for a 1-D vector (keepdims: shape [1])."""
    n = x.shape[-1]
    x = np.concatenate([x, np.zeros((1 << max(n - 1, 0).bit_length()) - n, x.dtype)])
    while x.shape[-1] > 1:
        x = x[0::2] + x[1::2]
    return x * np.float32(1 / n)


def _quantize_scales(absmax: np.ndarray) -> dict:
    """As quant._quantize_scales for one layer's [n_blocks] absmaxes."""
    n_blocks = absmax.shape[-1]
    offset = pairwise_mean(absmax)
    centered = absmax - offset
    centered = np.concatenate([centered, np.zeros(-n_blocks % SCALE_BLOCK, np.float32)]).reshape(-1, SCALE_BLOCK)
    scale = np.max(np.abs(centered), axis=-1) * INV_INT8_MAX
    q = np.clip(np.round(centered * _inverse(scale)[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return {"absmax_q": q.reshape(-1)[:n_blocks], "absmax_scale": scale, "absmax_offset": offset}
