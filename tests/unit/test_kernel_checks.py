"""The kernel tests' shared check (tests/kernel_checks.py) fails where it should."""
import jax.numpy as jnp

from kernel_checks import assert_close


def test_assert_close_rejects_a_wrong_value():
    assert_close(jnp.ones(3), jnp.ones(3), 1e-6, "same")
    try:
        assert_close(jnp.array([1.0, 1.1]), jnp.ones(2), 1e-3, "off")
    except AssertionError:
        return
    raise AssertionError("assert_close accepted a 10% error")
