"""Stochastic rounding fp32 -> bf16 (jaxmem.optim.stochastic_round): unbiased over many draws, always one of
the two neighbouring bf16 values, exact on bf16 values, deterministic per (seed, step) key."""
import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.optim import stochastic_round as sr


def _between_neighbours(n=64):
    """(x, lower, upper, p): fp32 values strictly between two bf16 neighbours, lower and upper those
    neighbours (lower the smaller magnitude), p the chance of rounding to upper; both signs, many binades."""
    rng = np.random.default_rng(0)
    sign = rng.integers(0, 2, n).astype(np.uint32) << 31
    exponent = rng.integers(127 - 20, 127 + 20, n).astype(np.uint32) << 23
    high = sign | exponent | (rng.integers(0, 128, n).astype(np.uint32) << 16)  # a bf16 pattern
    low = rng.integers(1, 2 ** 16, n).astype(np.uint32)
    as_float = lambda bits: bits.view(np.float32).astype(np.float64)  # noqa: E731
    return (high | low).view(np.float32), as_float(high), as_float(high + (1 << 16)), low / 2 ** 16


def test_unbiased():
    """Each draw is one of the value's two bf16 neighbours, and the mean of 20000 draws of each value is the
    value within 5 standard errors of that Bernoulli choice."""
    x, lower, upper, p = _between_neighbours()
    draws = 20000
    rounded = np.asarray(sr.to_bf16(jnp.tile(jnp.asarray(x), (draws, 1)), sr.step_key(0, 7)), np.float64)
    assert np.all((rounded == lower) | (rounded == upper))
    stderr = np.abs(upper - lower) * np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(rounded.mean(0) - x) <= 5 * stderr)
    up = (rounded == upper).mean(0)
    assert np.all(np.abs(up - p) <= 5 * np.sqrt(p * (1 - p) / draws) + 1e-9)


def test_exact_values_and_specials():
    """bf16 values, zeros, infinities and NaN come back as they are."""
    exact = jnp.asarray([0.0, -0.0, 1.0, -2.5, 3.0e38, jnp.inf, -jnp.inf], jnp.float32)
    out = sr.to_bf16(exact, sr.step_key(1, 0))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(exact.astype(jnp.bfloat16), np.float32))
    assert np.isnan(np.asarray(sr.to_bf16(jnp.asarray([jnp.nan]), sr.step_key(1, 0)), np.float32)).all()


def test_deterministic_per_key():
    """The same (seed, step) draws the same bits (a resumed run rounds as the first did); another step or seed
    other bits; inside jit with a traced step too; tree leaves draw independently."""
    x = jnp.tile(jnp.asarray(_between_neighbours()[0]), (16, 1))
    same = [np.asarray(sr.to_bf16(x, sr.step_key(3, 5)), np.float32) for _ in range(2)]
    np.testing.assert_array_equal(*same)
    traced = jax.jit(lambda x, step: sr.to_bf16(x, sr.step_key(3, step)))(x, jnp.int32(5))
    np.testing.assert_array_equal(np.asarray(traced, np.float32), same[0])
    assert np.any(np.asarray(sr.to_bf16(x, sr.step_key(3, 6)), np.float32) != same[0])
    assert np.any(np.asarray(sr.to_bf16(x, sr.step_key(4, 5)), np.float32) != same[0])
    tree = sr.tree_to_bf16({"a": x, "b": x}, sr.step_key(3, 5))
    assert tree["a"].dtype == jnp.bfloat16 and np.any(np.asarray(tree["a"] != tree["b"]))
