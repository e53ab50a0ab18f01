"""Frozen base weights stored quantized for QLoRA: int8 per output channel, or NF4 in blocks.

Every quantized form is a dict of arrays whose leading dims are the weight's leading batch dims (the
stacked layer dim L), so slicing each leaf along L gives that layer's quantized form and the layer scan
can fetch and dequantize one layer at a time. All functions are pure jnp and jittable.

NF4 (QLoRA, Dettmers et al. 2023): each block of `block` consecutive elements of a layer's flattened weight
keeps its absmax in fp32 and, per element, the index of the code value nearest to w / absmax; two 4-bit
indices share a byte, the even element in the low nibble. Double quantization stores the block absmaxes
as int8 around their mean, with an fp32 scale per SCALE_BLOCK of them.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# The 16 NormalFloat-4 code values (QLoRA paper, appendix E; bitsandbytes' NF4 table), ascending.
NF4_CODES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0)
NF4_MAX_GAP = float(np.max(np.diff(np.asarray(NF4_CODES, np.float32))))  # largest step between codes
SCALE_BLOCK = 256  # block absmaxes per fp32 scale under double quantization
INT8_MAX = 127
# Scales are absmax * (1/127), written as a product: XLA rewrites a division by a constant into that
# product anyway, so spelling it out keeps every backend (and numpy references) bit-identical.
INV_INT8_MAX = np.float32(1 / INT8_MAX)


def _safe(scale: jnp.ndarray) -> jnp.ndarray:
    """A divisor for `scale`: all-zero channels / blocks divide by 1 and quantize to 0."""
    return jnp.where(scale == 0, jnp.ones_like(scale), scale)


def _inverse(scale: jnp.ndarray) -> jnp.ndarray:
    """1 / scale (1 where scale is 0), on the small scale array: values are quantized as w * (1 / scale), a
    product, because XLA rewrites w / broadcast(scale) into that product in some fusions and not in others;
    spelled out, every backend and the host's numpy (jaxmem.lora.quant_host) round alike."""
    return jnp.float32(1) / _safe(scale)


# ---- int8, per output channel ----

def quantize_int8(w: jnp.ndarray, in_axes: tuple[int, ...]) -> dict:
    """{"q": int8 like w, "scale": fp32 with size 1 on `in_axes`}: scale = absmax over the input axes * (1/127)."""
    in_axes = tuple(a % w.ndim for a in in_axes)
    w32 = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=in_axes, keepdims=True) * INV_INT8_MAX
    q = jnp.clip(jnp.round(w32 * _inverse(scale)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return {"q": q, "scale": scale}


def dequantize_int8(qt: dict, dtype=jnp.float32) -> jnp.ndarray:
    return (qt["q"].astype(jnp.float32) * qt["scale"]).astype(dtype)


# ---- NF4, in blocks of the flattened weight ----

def _blocks(flat: jnp.ndarray, block: int) -> jnp.ndarray:
    """[*batch, n] -> [*batch, n_blocks, block], the last block padded with zeros."""
    pad = -flat.shape[-1] % block
    flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)])
    return flat.reshape(*flat.shape[:-1], -1, block)


def nearest_nf4(x: jnp.ndarray) -> jnp.ndarray:
    """The index (uint8, 0..15) of the NF4 code nearest to each x; a tie goes to the lower code.

    One elementwise pass per code (no [..., 16] temporary), the same comparisons as an argmin.
    """
    best = jnp.zeros(x.shape, jnp.uint8)
    best_distance = jnp.abs(x - NF4_CODES[0])
    for i, code in enumerate(NF4_CODES[1:], start=1):
        distance = jnp.abs(x - jnp.float32(code))
        closer = distance < best_distance
        best = jnp.where(closer, jnp.uint8(i), best)
        best_distance = jnp.where(closer, distance, best_distance)
    return best


def pairwise_mean(x: jnp.ndarray) -> jnp.ndarray:
    """The mean over the last dim, keepdims, summed in a fixed pairwise order (zero-padded to a power of two,
    then x[0::2] + x[1::2] until one is left) and times 1/n: elementwise adds only, so every backend and the
    host's numpy (jaxmem.lora.quant_host) round it the same, unlike a reduction whose order XLA picks."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << max(n - 1, 0).bit_length()) - n)])
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x * np.float32(1 / n)


def _quantize_scales(absmax: jnp.ndarray, n_blocks: int) -> dict:
    """Double quantization of the [*batch, n_blocks] fp32 absmaxes: int8 around their mean, blockwise absmax."""
    offset = pairwise_mean(absmax)
    centered = _blocks(absmax - offset, SCALE_BLOCK)  # [*batch, n_scale_blocks, SCALE_BLOCK]
    scale = jnp.max(jnp.abs(centered), axis=-1) * INV_INT8_MAX
    q = jnp.clip(jnp.round(centered * _inverse(scale)[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    q = q.reshape(*q.shape[:-2], -1)[..., :n_blocks]
    return {"absmax_q": q, "absmax_scale": scale, "absmax_offset": offset}


def _dequantize_scales(qt: dict) -> jnp.ndarray:
    q = qt["absmax_q"]
    n_blocks = q.shape[-1]
    blocks = _blocks(q.astype(jnp.float32), SCALE_BLOCK) * qt["absmax_scale"][..., None]
    return blocks.reshape(*q.shape[:-1], -1)[..., :n_blocks] + qt["absmax_offset"]


def quantize_nf4(w: jnp.ndarray, block: int = 64, double_quant: bool = False, batch_dims: int = 0) -> dict:
    """NF4 form of `w`; the first `batch_dims` dims (1 for a stacked [L, ...] weight) are kept, each item's
    remaining dims are flattened and quantized separately.

    Returns {"codes": uint8 [*batch, n_padded / 2], "absmax": fp32 [*batch, n_blocks]}; with double_quant,
    "absmax" is replaced by "absmax_q" int8 [*batch, n_blocks], "absmax_scale" fp32
    [*batch, ceil(n_blocks / SCALE_BLOCK)] and "absmax_offset" fp32 [*batch, 1].
    """
    if block % 2:
        raise ValueError(f"nf4 block size must be even, got {block}")
    batch = w.shape[:batch_dims]
    blocks = _blocks(w.astype(jnp.float32).reshape(*batch, -1), block)  # [*batch, n_blocks, block]
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    indices = nearest_nf4(blocks * _inverse(absmax)[..., None]).reshape(*batch, -1)
    codes = indices[..., 0::2] | (indices[..., 1::2] << 4)
    if not double_quant:
        return {"codes": codes, "absmax": absmax}
    return {"codes": codes, **_quantize_scales(absmax, absmax.shape[-1])}


def nf4_absmax(qt: dict) -> jnp.ndarray:
    """The fp32 block absmaxes [*batch, n_blocks] (dequantized when double-quantized)."""
    return qt["absmax"] if "absmax" in qt else _dequantize_scales(qt)


def dequantize_nf4(qt: dict, shape: tuple[int, ...], dtype=jnp.float32) -> jnp.ndarray:
    """The weight of `shape` (its batch dims included) back from its NF4 form."""
    codes = qt["codes"]
    batch = codes.shape[:-1]
    absmax = nf4_absmax(qt)
    indices = jnp.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(*batch, absmax.shape[-1], -1)
    values = jnp.asarray(NF4_CODES, jnp.float32)[indices] * absmax[..., None]
    n = math.prod(shape[len(batch):])
    return values.reshape(*batch, -1)[..., :n].reshape(shape).astype(dtype)


# ---- stored sizes ----

def quantized_bytes(shape: tuple[int, ...], base_dtype: str, double_quant: bool = False, *,
                    block: int = 64, batch_dims: int = 0, in_axes: tuple[int, ...] = (0,)) -> int:
    """Bytes of the stored form of a weight of `shape`: base_dtype "nf4" (with `block`, `batch_dims` as in
    quantize_nf4), "int8" (per output channel, reducing `in_axes`), or a float dtype name (unquantized)."""
    if base_dtype == "nf4":
        items = math.prod(shape[:batch_dims])
        n_blocks = -(-math.prod(shape[batch_dims:]) // block)
        per_item = n_blocks * block // 2  # packed codes
        if double_quant:
            per_item += n_blocks + 4 * -(-n_blocks // SCALE_BLOCK) + 4
        else:
            per_item += 4 * n_blocks
        return items * per_item
    if base_dtype == "int8":
        in_axes = {a % len(shape) for a in in_axes}
        channels = math.prod(s for i, s in enumerate(shape) if i not in in_axes)
        return math.prod(shape) + 4 * channels
    return math.prod(shape) * np.dtype(jnp.dtype(base_dtype)).itemsize


def dequantize(base_dtype: str, stored, shape: tuple[int, ...], dtype):
    """A weight of `shape` in `dtype` from its stored form (bf16 / fp32 array, or int8 / nf4 leaves)."""
    if base_dtype == "int8":
        return dequantize_int8(stored, dtype)
    if base_dtype == "nf4":
        return dequantize_nf4(stored, shape, dtype)
    return stored.astype(dtype)
