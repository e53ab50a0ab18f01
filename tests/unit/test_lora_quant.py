"""jaxmem.core.quant against numpy references of the same schemes: codes, scales, packing, error bounds, jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.core import quant
from jaxmem.core.quant import NF4_CODES, NF4_MAX_GAP, SCALE_BLOCK, quantized_bytes

# Compiled once per shape (faster than op-by-op); test_jit_matches_eager checks the eager path agrees.
quantize_int8 = jax.jit(quant.quantize_int8, static_argnums=1)
dequantize_int8 = jax.jit(quant.dequantize_int8, static_argnums=1)
quantize_nf4 = jax.jit(quant.quantize_nf4, static_argnames=("block", "double_quant", "batch_dims"))
dequantize_nf4 = jax.jit(quant.dequantize_nf4, static_argnums=(1, 2))
nf4_absmax = jax.jit(quant.nf4_absmax)

CODES = np.asarray(NF4_CODES, np.float32)


def _weight(shape, seed=0):
    w = np.random.RandomState(seed).standard_normal(shape).astype(np.float32)
    return w * np.float32(0.05)


# ---- numpy references ----

def ref_int8(w, in_axes):
    scale = np.max(np.abs(w), axis=in_axes, keepdims=True) * np.float32(1 / 127)
    q = np.clip(np.round(w * (np.float32(1) / np.where(scale == 0, np.float32(1), scale))), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def ref_nf4_layer(w, block):
    """One item: (packed codes, block absmax, indices) for the flattened w padded with zeros."""
    flat = w.reshape(-1)
    flat = np.concatenate([flat, np.zeros(-flat.size % block, np.float32)])
    blocks = flat.reshape(-1, block)
    absmax = np.abs(blocks).max(axis=1)
    x = blocks * (np.float32(1) / np.where(absmax == 0, np.float32(1), absmax))[:, None]
    indices = np.argmin(np.abs(x[..., None] - CODES), axis=-1).astype(np.uint8).reshape(-1)
    packed = np.array([(lo | (hi << 4)) for lo, hi in zip(indices[0::2], indices[1::2])], np.uint8)
    return packed, absmax, indices


def ref_nf4_dequant(indices, absmax, shape, block):
    values = CODES[indices].reshape(-1, block) * absmax[:, None]
    return values.reshape(-1)[:int(np.prod(shape))].reshape(shape)


# ---- int8 ----

@pytest.mark.parametrize("shape,in_axes", [((48, 4, 8), (0,)), ((4, 8, 48), (0, 1)), ((3, 48, 4, 8), (1,))])
def test_int8_matches_reference_and_bound(shape, in_axes):
    w = _weight(shape)
    w[..., 0] = 0.0  # an all-zero channel (or part of one) stays exact
    qt = quantize_int8(jnp.asarray(w), in_axes)
    q, scale = ref_int8(w, in_axes)
    assert qt["q"].dtype == jnp.int8 and qt["scale"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(qt["q"]), q)
    np.testing.assert_array_equal(np.asarray(qt["scale"]), scale)
    back = np.asarray(dequantize_int8(qt, jnp.float32))
    assert np.all(np.abs(w - back) <= 0.5 * scale * (1 + 1e-6))
    assert np.abs(np.asarray(qt["q"])).max() == 127  # the absmax element of each channel uses the full range
    assert dequantize_int8(qt, jnp.bfloat16).dtype == jnp.bfloat16


# ---- nf4 ----

def test_nf4_codes_are_sorted_and_symmetric_ends():
    assert len(NF4_CODES) == 16 and NF4_CODES[0] == -1.0 and NF4_CODES[7] == 0.0 and NF4_CODES[15] == 1.0
    assert np.all(np.diff(CODES) > 0)
    assert NF4_MAX_GAP == pytest.approx(-0.6961928009986877 - -1.0)  # the widest gap is at -1


@pytest.mark.parametrize("shape,block", [((64, 12), 64), ((40, 7), 64), ((5, 9), 16)])
def test_nf4_matches_reference(shape, block):
    w = _weight(shape, seed=1)
    qt = quantize_nf4(jnp.asarray(w), block=block)
    packed, absmax, indices = ref_nf4_layer(w, block)
    assert set(qt) == {"codes", "absmax"} and qt["codes"].dtype == jnp.uint8 and qt["absmax"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(qt["codes"]), packed)
    np.testing.assert_array_equal(np.asarray(qt["absmax"]), absmax)
    back = np.asarray(dequantize_nf4(qt, shape, jnp.float32))
    np.testing.assert_array_equal(back, ref_nf4_dequant(indices, absmax, shape, block))
    # nearest code: off by at most half the largest gap between codes, times the block's absmax
    per_element_absmax = np.repeat(absmax, block)[:w.size].reshape(shape)
    assert np.all(np.abs(w - back) <= 0.5 * NF4_MAX_GAP * per_element_absmax * (1 + 1e-6))


def test_nf4_packing_low_nibble_is_even_element():
    # One block whose elements hit the codes exactly: element i -> code (3 * i) % 16, absmax 1.
    indices = (3 * np.arange(64)) % 16
    w = CODES[indices]
    qt = quantize_nf4(jnp.asarray(w), block=64)
    codes = np.asarray(qt["codes"])
    np.testing.assert_array_equal(codes & 0x0F, indices[0::2])
    np.testing.assert_array_equal(codes >> 4, indices[1::2])
    assert codes[0] == indices[0] | (indices[1] << 4) == 0x30
    np.testing.assert_array_equal(np.asarray(dequantize_nf4(qt, w.shape)), w)


def test_nf4_stacked_layers_slice_to_each_layers_form():
    w = _weight((3, 40, 6), seed=2)  # [L, D, F]; 240 elements per layer, not a multiple of the block
    for double_quant in (False, True):
        qt = quantize_nf4(jnp.asarray(w), block=64, double_quant=double_quant, batch_dims=1)
        assert all(leaf.shape[0] == 3 for leaf in qt.values())
        whole = np.asarray(dequantize_nf4(qt, w.shape))
        for layer in range(3):
            one = quantize_nf4(jnp.asarray(w[layer]), block=64, double_quant=double_quant)
            sliced = {k: v[layer] for k, v in qt.items()}
            for k in one:
                np.testing.assert_array_equal(np.asarray(sliced[k]), np.asarray(one[k]))
            np.testing.assert_array_equal(np.asarray(dequantize_nf4(sliced, w.shape[1:])), whole[layer])
        if not double_quant:
            for layer in range(3):
                packed, absmax, _ = ref_nf4_layer(w[layer], 64)
                np.testing.assert_array_equal(np.asarray(qt["codes"][layer]), packed)
                np.testing.assert_array_equal(np.asarray(qt["absmax"][layer]), absmax)


def test_nf4_double_quant_scales_bound():
    # 2 layers x 600 blocks of 64: the scales span 3 blocks of 256, the last one partial.
    w = _weight((2, 600 * 64), seed=3) * np.linspace(0.1, 3.0, 600 * 64, dtype=np.float32)
    qt = quantize_nf4(jnp.asarray(w), double_quant=True, batch_dims=1)
    assert qt["absmax_q"].dtype == jnp.int8 and qt["absmax_q"].shape == (2, 600)
    assert qt["absmax_scale"].shape == (2, 3) and qt["absmax_offset"].shape == (2, 1)
    exact = np.stack([ref_nf4_layer(w[i], 64)[1] for i in range(2)])
    offset = exact.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(qt["absmax_offset"]), offset, rtol=1e-6)
    centered = np.pad(exact - offset, [(0, 0), (0, 3 * SCALE_BLOCK - 600)]).reshape(2, 3, SCALE_BLOCK)
    step = np.abs(centered).max(axis=2) * np.float32(1 / 127)
    np.testing.assert_allclose(np.asarray(qt["absmax_scale"]), step, rtol=1e-5)
    scales = np.asarray(nf4_absmax(qt))
    bound = 0.5 * np.repeat(step, SCALE_BLOCK, axis=1)[:, :600] * (1 + 1e-4) + 1e-7
    assert np.all(np.abs(scales - exact) <= bound)
    assert np.abs(scales - exact).max() > 0  # the scales really are quantized
    # the weights then round against the dequantized scales: same bound with those scales
    back = np.asarray(dequantize_nf4(qt, w.shape))
    codes_exact = np.asarray(quantize_nf4(jnp.asarray(w), batch_dims=1)["codes"])
    np.testing.assert_array_equal(np.asarray(qt["codes"]), codes_exact)  # codes use the exact absmax
    per_element = np.repeat(exact, 64, axis=1)
    per_element_q = np.repeat(scales, 64, axis=1)
    err = np.abs(w - back)
    assert np.all(err <= 0.5 * NF4_MAX_GAP * per_element + np.abs(per_element_q - per_element) + 1e-7)


def test_jit_matches_eager():
    w = jnp.asarray(_weight((2, 32, 8), seed=4)).astype(jnp.bfloat16)
    for double_quant in (False, True):
        jitted = quantize_nf4(w, double_quant=double_quant, batch_dims=1)
        eager = quant.quantize_nf4(w, double_quant=double_quant, batch_dims=1)
        for k in eager:
            np.testing.assert_array_equal(np.asarray(jitted[k]), np.asarray(eager[k]))
        back = dequantize_nf4(jitted, (2, 32, 8), jnp.bfloat16)
        assert back.dtype == jnp.bfloat16 and back.shape == w.shape
        np.testing.assert_array_equal(np.asarray(back, np.float32),
                                      np.asarray(quant.dequantize_nf4(eager, (2, 32, 8), jnp.bfloat16), np.float32))
    # one layer dequantized inside jit from the stacked form, the way a layer scan fetches it
    layer = jax.jit(lambda qt, i: quant.dequantize_nf4(jax.tree.map(lambda x: x[i], qt), (32, 8)))(jitted, 1)
    np.testing.assert_array_equal(np.asarray(layer), np.asarray(dequantize_nf4(jitted, (2, 32, 8))[1]))
    int8 = quantize_int8(w, (1,))
    np.testing.assert_array_equal(np.asarray(int8["q"]), np.asarray(quant.quantize_int8(w, (1,))["q"]))
    np.testing.assert_array_equal(np.asarray(int8["scale"]), np.asarray(quant.quantize_int8(w, (1,))["scale"]))


def test_all_zero_block():
    w = np.zeros((128,), np.float32)
    w[64:] = _weight((64,))
    qt = quantize_nf4(jnp.asarray(w))
    back = np.asarray(dequantize_nf4(qt, w.shape))
    assert np.all(back[:64] == 0) and np.asarray(qt["absmax"])[0] == 0


@pytest.mark.parametrize("shape,batch_dims,double_quant", [((3, 40, 6), 1, False), ((3, 40, 6), 1, True),
                                                           ((600 * 64 + 5,), 0, True), ((40, 7), 0, False)])
def test_quantized_bytes_counts_the_leaves(shape, batch_dims, double_quant):
    qt = quantize_nf4(jnp.zeros(shape), double_quant=double_quant, batch_dims=batch_dims)
    assert quantized_bytes(shape, "nf4", double_quant, batch_dims=batch_dims) == sum(x.nbytes for x in qt.values())
    int8 = quantize_int8(jnp.zeros((3, 40, 6)), (1,))
    assert quantized_bytes((3, 40, 6), "int8", in_axes=(1,)) == sum(x.nbytes for x in int8.values())
    assert quantized_bytes((3, 40, 6), "bfloat16") == 3 * 40 * 6 * 2
