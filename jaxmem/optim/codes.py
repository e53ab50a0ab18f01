"""Block-wise quantization of optimizer moments: a per-block absmax scale and a non-linear code.

A tensor's blocks run along its last dim, so the codes keep the tensor's shape (8-bit: one uint8 per value;
4-bit: two per uint8, adjacent values paired along the last dim) and the scales have shape
`shape[:-1] + (blocks,)`: a partition spec of the tensor applies to its codes, and slicing a leading dim
(a layer out of a `[L, ...]` stack) slices codes and scales alike.

Block rule: a last dim `d` of at most `block` values is one block of `d`; a longer one is cut in blocks of
`block`, the last padded with zeros inside `quantize` (padding never reaches the stored codes). The rule
depends on the shape only, never on the mesh, so a checkpoint restores onto any other mesh.

Each block's scale is its value of largest magnitude, sign included, so that value maps to the code's +1
exactly (a signed code has +1 but not -1). An all-zero block has scale 0 and dequantizes to zeros.

Codes (values of the normalized x / scale, nearest value chosen):
- `dynamic8_signed` / `dynamic8_unsigned`: the dynamic tree code of bitsandbytes (arXiv 2110.02861): a
  decimal exponent level then linear fraction bits, so small and large magnitudes both keep ~2-3 digits.
- `dynamic4_signed`: the same construction in 4 bits (3 exponent levels), the first-moment code of
  arXiv 2309.01507 (4-bit AdamW, blocks of 128) and of torchao's 4-bit AdamW.
- `linear_square4`: 16 values (k / 16)^2, k = 1..16: a linear code of sqrt(v), the quantity Adam divides
  by, with no zero (2309.01507's "zero-point problem": a second moment rounded to 0 turns m / sqrt(v) into
  m / eps). Rounded to the nearest value of sqrt.
The unsigned 8-bit code has no zero either: its zero is replaced by the bottom level's lower edge.
- `e4m3_signed` / `e4m3_unsigned`: no table lookup: x / scale times float8_e4m3fn's largest value (448) cast
  to that dtype (round to nearest even), the codes stored as float8_e4m3fn (fp8 moments, as torchao's
  AdamWFp8: e4m3 values with a per-block scale). Three mantissa bits keep every value from 2^-6 / 448 of its
  block's scale up within 1/16 of itself, whatever its decade. The unsigned one (v) rounds a positive value
  below e4m3's smallest subnormal up to it rather than to 0, like the unsigned 8-bit code (the zero-point
  problem above).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Code:
    """A sorted table of normalized values (`values`, 2**bits of them) and how to round to it."""

    name: str
    bits: int
    signed: bool
    values: tuple[float, ...]
    sqrt_linear: bool = False  # round in the sqrt domain with a closed form (linear_square4)
    storage: str | None = None  # a float8 dtype the codes are cast to and stored in (e4m3), else uint8 indices

    @functools.cached_property
    def table(self) -> np.ndarray:
        return np.asarray(self.values, np.float32)

    @functools.cached_property
    def midpoints(self) -> np.ndarray:
        """Thresholds between neighbouring values: code i covers [midpoints[i-1], midpoints[i])."""
        v = np.asarray(self.values, np.float64)
        return ((v[1:] + v[:-1]) / 2).astype(np.float32)

    @functools.cached_property
    def buckets(self) -> np.ndarray:
        """A lookup for the host kernel's encoder (jaxmem.kernels.host_adamw): uint16[2^15] indexed by a float32's
        sign, its exponent's low 7 bits and its top 7 mantissa bits (every |y| <= 1 has an exponent below 128):
        the number of midpoints at or below the bucket's lowest value. No bucket holds two midpoints, so the
        index of y is that count, plus one if y reaches the next midpoint (`padded_midpoints`)."""
        keys = np.arange(1 << 15, dtype=np.uint32)
        low_bits = ((keys >> 7) & 127) << 23 | (keys & 127) << 16
        low, high = (b.astype(np.uint32).view(np.float32) for b in (low_bits, low_bits | 0xFFFF))
        negative = keys >> 14 == 1
        lower, upper = np.where(negative, -high, low), np.where(negative, -low, high)
        base = np.searchsorted(self.midpoints, lower, side="right")
        if np.any(np.searchsorted(self.midpoints, upper, side="right") - base > 1):
            raise ValueError(f"code {self.name}: a bucket of 2^-7 of an octave holds two midpoints")
        return base.astype(np.uint16)

    @functools.cached_property
    def padded_midpoints(self) -> np.ndarray:
        """The midpoints and a +inf after them (the host kernel's encoder reads one past the last)."""
        return np.append(self.midpoints, np.float32(np.inf)).astype(np.float32)

    @functools.cached_property
    def max_error(self) -> float:
        """The largest |dequantized - x| as a fraction of the block's |scale|: half the widest gap between
        neighbouring values, or the part of [-1, 1] below the lowest value (a signed code has no -1); for
        the sqrt-linear code, sqrt within a half step w gives v within w * (2 + w)."""
        v = np.asarray(self.values, np.float64)
        if self.sqrt_linear:
            w = np.max(np.diff(np.sqrt(v))) / 2
            return float(w * (2 + w))
        return float(max(np.max(np.diff(v)) / 2, v[0] + 1 if self.signed else 0.0))

    @property
    def zero_index(self) -> int:
        """The code nearest 0 (what a zero tensor stores)."""
        return int(np.argmin(np.abs(np.asarray(self.values))))


def dynamic_tree_values(bits: int, signed: bool, zero: bool = True) -> tuple[float, ...]:
    """The dynamic tree code's 2**bits values in [-1, 1] (signed) or [0, 1].

    Levels k = 0 .. bits-2 cover magnitudes 10**(k - bits + 2) * [0.1, 1]; level k holds 2**k values (2**(k+1)
    unsigned: the sign bit becomes a fraction bit), the midpoints of that many equal parts of [0.1, 1]. With 0
    and 1 that makes 2**bits. `zero=False` puts the bottom level's lower edge where 0 was."""
    levels = bits - 1
    magnitudes = []
    for k in range(levels):
        n = 2 ** k if signed else 2 ** (k + 1)
        edges = np.linspace(0.1, 1.0, n + 1)
        magnitudes += list(10.0 ** (k - levels + 1) * (edges[:-1] + edges[1:]) / 2)
    values = magnitudes + ([-m for m in magnitudes] if signed else [])
    values += [0.0 if zero else 0.1 * 10.0 ** (1 - levels), 1.0]
    assert len(values) == 2 ** bits
    return tuple(float(v) for v in sorted(values))


def float8_values(dtype_name: str, signed: bool) -> tuple[float, ...]:
    """A float8 dtype's distinct finite values over its largest (signed), or its positive ones (unsigned)."""
    dtype = getattr(ml_dtypes, dtype_name)
    values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
    values = np.unique(values[np.isfinite(values)]) / float(ml_dtypes.finfo(dtype).max)
    return tuple(float(v) for v in (values if signed else values[values > 0]))


CODES = {c.name: c for c in (
    Code("dynamic8_signed", 8, True, dynamic_tree_values(8, True)),
    Code("dynamic8_unsigned", 8, False, dynamic_tree_values(8, False, zero=False)),
    Code("dynamic4_signed", 4, True, dynamic_tree_values(4, True)),
    Code("linear_square4", 4, False, tuple((k / 16) ** 2 for k in range(1, 17)), sqrt_linear=True),
    Code("e4m3_signed", 8, True, float8_values("float8_e4m3fn", True), storage="float8_e4m3fn"),
    Code("e4m3_unsigned", 8, False, float8_values("float8_e4m3fn", False), storage="float8_e4m3fn"),
)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["codes", "scales"],
                   meta_fields=["code", "block", "last"])
@dataclasses.dataclass(frozen=True)
class QTensor:
    """A quantized tensor: `codes` (uint8, the tensor's shape; 4-bit: last dim ceil(last / 2); a float8 code:
    its dtype, the tensor's shape), `scales`
    (fp32, `shape[:-1] + (blocks,)`), and static meta: the code's name, the block length and the last dim."""

    codes: jax.Array
    scales: jax.Array
    code: str
    block: int
    last: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape[:-1]) + (self.last,)

    @property
    def nbytes(self) -> int:
        return self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


def is_quantized(x) -> bool:
    return isinstance(x, QTensor)


def block_for(last: int, block: int) -> tuple[int, int]:
    """(block length, blocks) along a last dim of `last` values under the block rule above."""
    length = max(1, min(block, last))
    return length, math.ceil(last / length)


def codes_shape(shape: tuple[int, ...], bits: int) -> tuple[int, ...]:
    last = shape[-1] if shape else 1
    return tuple(shape[:-1]) + ((last + 1) // 2 if bits == 4 else last,)


def scales_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (block_for(shape[-1] if shape else 1, block)[1],)


def zeros(shape: tuple[int, ...], code_name: str, block: int) -> QTensor:
    """The quantized zero tensor of `shape` (an optimizer's initial moment) without any arithmetic."""
    code = CODES[code_name]
    byte = code.zero_index * 17 if code.bits == 4 else code.zero_index  # both nibbles for 4 bits
    if code.storage:  # a float8 code's zero is 0 in its dtype
        stored = jnp.zeros(shape, code.storage)
    else:
        stored = jnp.full(codes_shape(shape, code.bits), byte, jnp.uint8)
    return QTensor(stored, jnp.zeros(scales_shape(shape, block), jnp.float32), code_name,
                   block_for(shape[-1], block)[0], shape[-1])


def _blocked(x: jax.Array, length: int, count: int) -> jax.Array:
    """x [..., last] zero-padded to count * length and split into [..., count, length]."""
    pad = count * length - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (count, length))


def _constant(values: np.ndarray, like: jax.Array) -> jax.Array:
    """A table as an array in `like`'s memory space (an update under host compute works on host values)."""
    table = jnp.asarray(values)
    space = jax.typeof(like).memory_space
    return table if jax.typeof(table).memory_space == space else jax.device_put(table, space)


def _lowering_for_cpu() -> bool:
    """Whether the computation being traced is for CPU devices: the default device's platform (a deviceless GPU
    compile lowers under a compile-only GPU default device: jaxmem.runtime.aot.lowering_target), else the
    default backend's."""
    device = jax.config.jax_default_device
    platform = getattr(device, "platform", None) or (device if isinstance(device, str) else jax.default_backend())
    return platform == "cpu"


def _encode(code: Code, y: jax.Array) -> jax.Array:
    """Index of the nearest code value to each normalized y: the number of midpoints at or below y. On a GPU
    every midpoint is compared and the hits summed, one fused reduction that writes only the index (the binary
    search's gathers left each step's comparisons and indices as tensor-sized temporaries of the update); on
    the host and on a CPU, where those cost host RAM and the 255 comparisons a value cost far more time, a
    binary search unrolled over the bits (no constant is broadcast, so host values stay on the host). Both
    give the same index."""
    if code.sqrt_linear:
        k = jnp.round(jnp.sqrt(jnp.maximum(y, 0.0)) * 16.0)
        return (jnp.clip(k, 1, 16) - 1).astype(jnp.uint8)
    midpoints = _constant(code.midpoints, y)
    if jax.typeof(y).memory_space != jax.memory.Space.Host and not _lowering_for_cpu():
        return jnp.sum(y[..., None] >= midpoints, axis=-1, dtype=jnp.int32).astype(jnp.uint8)
    step = 2 ** (code.bits - 1)
    idx = (y >= midpoints[step - 1]).astype(jnp.int32) * step
    while step > 1:
        step //= 2
        idx = idx + (y >= midpoints[idx + (step - 1)]).astype(jnp.int32) * step
    return idx.astype(jnp.uint8)


def _cast(code: Code, y: jax.Array) -> jax.Array:
    """Normalized y as a float8 code: y times the dtype's largest value, rounded to nearest by the cast; an
    unsigned code's positive values no lower than the smallest subnormal (no zero where v is not 0)."""
    info = ml_dtypes.finfo(getattr(ml_dtypes, code.storage))
    z = y * float(info.max)
    if not code.signed:
        z = jnp.where(z > 0, jnp.maximum(z, float(info.smallest_subnormal)), z)
    return z.astype(code.storage)


def _pack(idx: jax.Array) -> jax.Array:
    """Pairs of 4-bit indices along the last dim -> one uint8 (even element in the low nibble)."""
    if idx.shape[-1] % 2:
        idx = jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, 1)])
    pairs = idx.reshape(idx.shape[:-1] + (idx.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(codes: jax.Array, last: int) -> jax.Array:
    both = jnp.stack([codes & 15, codes >> 4], axis=-1)
    return both.reshape(codes.shape[:-1] + (2 * codes.shape[-1],))[..., :last]


def quantize(x: jax.Array, code_name: str, block: int) -> QTensor:
    """x (any float dtype, at least 1-D) as a QTensor of `code_name` with blocks of at most `block` values."""
    code = CODES[code_name]
    last = x.shape[-1]
    length, count = block_for(last, block)
    xb = _blocked(x.astype(jnp.float32), length, count)
    if code.signed:  # the value of largest magnitude, sign included: it maps to +1 exactly
        hi, lo = jnp.max(xb, axis=-1), jnp.min(xb, axis=-1)
        scales = jnp.where(hi >= -lo, hi, lo)
    else:
        scales = jnp.max(xb, axis=-1)
    safe = scales + (scales == 0).astype(scales.dtype)  # 1 for an all-zero block; no constant to place
    idx = (_cast if code.storage else _encode)(code, xb / safe[..., None])
    idx = idx.reshape(idx.shape[:-2] + (count * length,))[..., :last]
    return QTensor(_pack(idx) if code.bits == 4 else idx, scales, code_name, length, last)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
    """The values a QTensor stands for, [..., last] in `dtype`."""
    code = CODES[q.code]
    if code.storage:
        values = q.codes.astype(jnp.float32) * (1.0 / float(ml_dtypes.finfo(getattr(ml_dtypes, code.storage)).max))
    else:
        idx = _unpack(q.codes, q.last) if code.bits == 4 else q.codes
        values = _constant(code.table, idx)[idx.astype(jnp.int32)]
    count = q.scales.shape[-1]
    scale = jnp.broadcast_to(q.scales[..., None], q.scales.shape + (q.block,))
    scale = scale.reshape(q.scales.shape[:-1] + (count * q.block,))[..., :q.last]
    return (values * scale).astype(dtype)
