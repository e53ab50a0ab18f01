"""Block-wise moment codes (jaxmem.optim.codes) against a float64 reference: every value dequantizes to the
code value nearest its normalized value (so within the code's error bound), over tensors with outliers,
zeros, tiny values and odd shapes; the block layout (codes shaped like the tensor, scales per block along
the last dim) and the 4-bit packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.optim import codes

# Largest |dequantized - x| as a fraction of the block's scale (its largest magnitude), derived from the
# tables: half the widest gap between neighbouring values, or the distance from -1 to the most negative
# value where a signed code has no -1. dynamic8_signed: top level 64 values 0.9/64 apart -> 0.9/128, also
# 1 - (-0.99297) for y = -1. dynamic8_unsigned: 128 values -> 0.9/256. dynamic4_signed: top level 4 values
# 0.225 apart -> 0.1125 (and -1 -> -0.8875). linear_square4: sqrt within 1/32 -> v within (1/32)(2 + 1/32).
# e4m3 (float8 codes): 416 and 448 are its two largest values, so half their gap over 448.
ABS_BOUND = {"dynamic8_signed": 0.9 / 128, "dynamic8_unsigned": 0.9 / 256, "dynamic4_signed": 0.1125,
             "linear_square4": (2 + 1 / 32) / 32, "e4m3_signed": 16 / 448, "e4m3_unsigned": 16 / 448}
# Largest relative error |dequantized - x| / |x| for |x| >= 10**-k of the block's scale, per code and k: the
# tables' own maxima (test_tables sweeps them). A dynamic code's level 10**-k holds half as many values as
# the level above, so its relative error about doubles per decade; the top level's worst is a value half-way
# between its two lowest values, e.g. 8-bit signed (0.9/128) / 0.11406.
REL_BOUND = {"dynamic8_signed": {1: 0.0617, 2: 0.1098, 3: 0.1800},
             "dynamic8_unsigned": {1: 0.03285, 2: 0.0617, 3: 0.1098},
             "dynamic4_signed": {1: 0.4656, 2: 0.7106}, "linear_square4": {1: 0.1901, 2: 0.5625},
             # e4m3's 3 mantissa bits: half a step over 1 + 1/16 of it, in every decade of its normal range
             # (down to 2^-6 / 448 of the scale)
             "e4m3_signed": {k: 1 / 17 for k in (1, 2, 3, 4)}, "e4m3_unsigned": {k: 1 / 17 for k in (1, 2, 3, 4)}}
BLOCK = {8: 2048, 4: 128}


def _tensors():
    rng = np.random.default_rng(0)
    normal = rng.standard_normal((9, 41, 341))
    outliers = rng.standard_normal((7, 5000))
    outliers[rng.random(outliers.shape) < 1e-3] *= 1e4
    zeros = rng.standard_normal((6, 300))
    zeros[::2] = 0.0  # whole zero blocks
    zeros[:, ::3] = 0.0
    return {"normal_9x41x341": normal, "outliers_7x5000": outliers, "zeros_6x300": zeros,
            "tiny_3x4097": 1e-15 * rng.standard_normal((3, 4097)),
            "wide_range_2x4096": np.exp(rng.uniform(-30, 0, (2, 4096))) * rng.choice([-1, 1], (2, 4096)),
            "one_dim_5000": rng.standard_normal(5000), "ties_4x256": np.full((4, 256), -2.0)}


def _nearest_error(code, y):
    """|y - nearest code value| in float64 (in the sqrt domain for linear_square4, mapped back)."""
    values = np.asarray(code.values, np.float64)
    if code.sqrt_linear:
        k = np.clip(np.round(16 * np.sqrt(np.maximum(y, 0))), 1, 16)
        return np.abs((k / 16) ** 2 - y)
    above = np.clip(np.searchsorted(values, y), 1, len(values) - 1)
    return np.minimum(np.abs(values[above] - y), np.abs(values[above - 1] - y))


def _reference_scales(x, block):
    """Per-element block scale (signed extreme) in float64, blocks of the codes' rule along the last dim."""
    length, count = codes.block_for(x.shape[-1], block)
    padded = np.zeros(x.shape[:-1] + (count * length,))
    padded[..., :x.shape[-1]] = x
    blocks = padded.reshape(x.shape[:-1] + (count, length))
    hi, lo = blocks.max(-1), blocks.min(-1)
    scale = np.where(hi >= -lo, hi, lo)
    return np.repeat(scale, length, axis=-1)[..., :x.shape[-1]]


@pytest.mark.parametrize("name", sorted(codes.CODES))
def test_nearest_value_and_bounds(name):
    code = codes.CODES[name]
    quantize = jax.jit(lambda x: codes.quantize(x, name, BLOCK[code.bits]))
    for label, x64 in _tensors().items():
        x64 = x64 if code.signed else np.square(x64)
        x32 = x64.astype(np.float32)
        back = np.asarray(codes.dequantize(quantize(jnp.asarray(x32))), np.float64)
        x = x32.astype(np.float64)
        scale = _reference_scales(x, BLOCK[code.bits])
        y = np.divide(x, scale, out=np.zeros_like(x), where=scale != 0)
        err = np.abs(back - x)
        slack = 1e-6 * np.abs(scale) + 1e-45
        assert np.all(err <= np.abs(scale) * _nearest_error(code, y) + slack), (name, label)
        assert np.all(err <= np.abs(scale) * ABS_BOUND[name] + slack), (name, label)
        for k, bound in REL_BOUND[name].items():
            big = np.abs(y) >= 10.0 ** -k
            assert np.all(err[big] <= bound * np.abs(x[big]) + slack[big]), (name, label, k)
        assert np.all(back[scale == 0] == 0), (name, label)


@pytest.mark.parametrize("name", sorted(codes.CODES))
def test_tables(name):
    """2**bits sorted values in [-1, 1] (a float8 code: its dtype's distinct finite ones, the unsigned one's
    positive ones), +1 among them; the v codes have no zero, the m codes do."""
    code = codes.CODES[name]
    values = np.asarray(code.values)
    assert len(values) == ({True: 253, False: 126}[code.signed] if code.storage else 2 ** code.bits)
    assert np.all(np.diff(values) > 0)
    assert values[-1] == 1.0 and values[0] >= -1.0
    assert (0.0 in values) == code.signed
    # the bounds above are the tables' own: the widest half-gap, or the uncovered part of [-1, 1]
    assert code.max_error == pytest.approx(ABS_BOUND[name])
    for k, bound in REL_BOUND[name].items():
        y = np.geomspace(10.0 ** -k, 1.0, 200001)
        worst = np.max(_nearest_error(code, y) / y)
        assert worst <= bound < worst * 1.002, (k, worst)


@pytest.mark.parametrize("shape,bits,block,expected", [
    ((9, 41, 341), 8, 2048, ((9, 41, 341), (9, 41, 1), 341)),
    ((3, 4097), 8, 2048, ((3, 4097), (3, 3), 2048)),
    ((2, 7, 300), 4, 128, ((2, 7, 150), (2, 7, 3), 128)),
    ((5, 301), 4, 128, ((5, 151), (5, 3), 128)),
    ((4096,), 4, 128, ((2048,), (32,), 128)),
])
def test_layout(shape, bits, block, expected):
    """Codes keep the tensor's shape (4-bit: half the last dim, rounded up); scales one per block; a layer
    sliced out of a stack is the stack's codes and scales sliced."""
    name = "dynamic8_signed" if bits == 8 else "dynamic4_signed"
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
    q = codes.quantize(x, name, block)
    assert (q.codes.shape, q.scales.shape, q.block) == expected
    assert q.codes.dtype == jnp.uint8 and q.scales.dtype == jnp.float32 and q.shape == shape
    zero = codes.zeros(shape, name, block)
    assert (zero.codes.shape, zero.scales.shape, zero.block) == expected
    assert np.all(np.asarray(codes.dequantize(zero)) == 0)
    if len(shape) > 1:
        layer = jax.tree.map(lambda a: a[1], q)
        np.testing.assert_array_equal(np.asarray(codes.dequantize(layer)),
                                      np.asarray(codes.dequantize(codes.quantize(x[1], name, block))))


def test_pytree():
    """A QTensor is a pytree of its codes and scales (keyed paths for checkpoints) with static meta."""
    q = codes.quantize(jnp.ones((4, 8)), "dynamic8_unsigned", 2048)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path({"m": q})]
    assert paths == ["['m'].codes", "['m'].scales"]
    doubled = jax.tree.map(lambda a: a, q)
    assert (doubled.code, doubled.block, doubled.last) == ("dynamic8_unsigned", 8, 8)


@pytest.mark.parametrize("name", ["dynamic8_signed", "dynamic8_unsigned", "dynamic4_signed"])
def test_buckets_give_the_nearest_value_s_index(name):
    """The host kernel's encoder (Code.buckets, then one comparison) gives the number of midpoints at or below
    y, the index the binary search gives: for random values over [-1, 1] on a log scale, and each midpoint
    with its float neighbours."""
    code = codes.CODES[name]
    rng = np.random.default_rng(0)
    y = np.sign(rng.standard_normal(200_000)) * 10.0 ** rng.uniform(-9, 0, 200_000)
    mid = code.midpoints
    y = np.concatenate([y, mid, np.nextafter(mid, -2), np.nextafter(mid, 2), [0.0, -0.0, 1.0, -1.0]])
    y = y.astype(np.float32)
    bits = y.view(np.uint32)
    keys = (bits >> 31) << 14 | ((bits >> 23) & 127) << 7 | (bits >> 16) & 127
    base = code.buckets[keys].astype(np.int64)
    got = base + (y >= code.padded_midpoints[base])
    np.testing.assert_array_equal(got, np.searchsorted(mid, y, side="right"))
