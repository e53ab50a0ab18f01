"""Attention over a key/value cache (generation) equals the training kernels' reference where the masks agree:
the last query of a causal sequence over every key, with a window, with sinks; masked slots take no weight."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.kernels.attention.decode import cached_attention
from jaxmem.kernels.attention.reference import attention_reference
from jaxmem.model.kv_cache import visible


@pytest.fixture
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, 9, 4, 8))
    k, v = (jax.random.normal(key, (2, 9, 2, 8)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (4,))


@pytest.mark.parametrize("window, with_sinks", [(None, False), (4, False), (None, True), (3, True)])
def test_last_query_equals_the_reference(qkv, window, with_sinks):
    q, k, v, sinks = qkv
    sinks = sinks if with_sinks else None
    want = attention_reference(q, k, v, window=window, sinks=sinks, scale=0.3)[:, -1:]
    seen = visible(jnp.zeros((2,), jnp.int32), jnp.array([8]), 9, window)
    got = cached_attention(q[:, -1:], k, v, seen, scale=0.3, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_ring_entries_past_the_start_and_unwritten_are_masked():
    """A ring of 4 slots at query slot 5: entries hold slots 4, 5, 2, 3; a row starting at slot 3 sees 3, 4, 5;
    at query slot 1 only slots 0 and 1 are written."""
    seen = visible(jnp.array([0, 3]), jnp.array([5]), 4, None)
    np.testing.assert_array_equal(np.asarray(seen[:, 0]), [[True, True, True, True], [True, True, False, True]])
    early = visible(jnp.array([0]), jnp.array([1]), 4, None)
    np.testing.assert_array_equal(np.asarray(early[0, 0]), [True, True, False, False])
    windowed = visible(jnp.array([0]), jnp.array([5]), 4, 2)  # slots 4 and 5 only
    np.testing.assert_array_equal(np.asarray(windowed[0, 0]), [True, True, False, False])
