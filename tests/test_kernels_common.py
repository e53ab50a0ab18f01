"""Shared helpers of the kernel tests: per-dtype tolerances and a relative max-error check."""
import jax.numpy as jnp
import numpy as np

# (forward rtol, gradient tolerance as max |err| / max |ref|): bf16 inputs vs the fp32 reference
TOLERANCES = {jnp.float32: (2e-5, 2e-5), jnp.bfloat16: (2e-2, 3e-2)}


def assert_close(actual, expected, tol, what):
    actual = np.asarray(jnp.asarray(actual, jnp.float32))
    expected = np.asarray(jnp.asarray(expected, jnp.float32))
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = max(float(np.max(np.abs(expected))), 1e-6)
    err = float(np.max(np.abs(actual - expected)))
    assert err <= tol * scale, f"{what}: max |err| {err:.3g} > {tol} x max |ref| {scale:.3g}"


def test_assert_close_rejects_a_wrong_value():
    assert_close(jnp.ones(3), jnp.ones(3), 1e-6, "same")
    try:
        assert_close(jnp.array([1.0, 1.1]), jnp.ones(2), 1e-3, "off")
    except AssertionError:
        return
    raise AssertionError("assert_close accepted a 10% error")
