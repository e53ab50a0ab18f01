"""Generation's token choice: the top-k and top-p filters against numpy references, greedy, draws that follow
the filtered distribution, bucketed lengths and one-line errors for bad settings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config import ConfigError
from jaxmem.generation.buckets import batch_bucket, bucket
from jaxmem.generation.loop import completion_lengths, left_pad
from jaxmem.generation.sampling import Sampling, next_token, top_k_filter, top_p_filter


def _np_top_k(logits, k):
    out = logits.copy()
    for row in out:
        kth = np.sort(row)[::-1][k - 1]
        row[row < kth] = -np.inf
    return out


def _np_top_p(logits, p):
    """transformers' rule: sorted ascending, drop the tokens whose cumulative probability is <= 1 - p, keep the
    most likely one always."""
    out = logits.copy()
    for row in out:
        order = np.argsort(row, kind="stable")
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        drop = np.cumsum(probs) <= 1 - p
        drop[-1] = False
        row[order[drop]] = -np.inf
    return out


@pytest.fixture
def logits():
    return np.random.RandomState(0).normal(size=(6, 50)).astype(np.float32) * 2


@pytest.mark.parametrize("k", [1, 5, 49])
def test_top_k_matches_numpy(logits, k):
    np.testing.assert_array_equal(np.asarray(top_k_filter(jnp.asarray(logits), k)), _np_top_k(logits, k))


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_matches_numpy(logits, p):
    np.testing.assert_array_equal(np.asarray(top_p_filter(jnp.asarray(logits), p)), _np_top_p(logits, p))


def test_filters_off_leave_logits(logits):
    x = jnp.asarray(logits)
    assert top_k_filter(x, 0) is x and top_p_filter(x, 1.0) is x


def test_greedy_is_argmax(logits):
    got = next_token(jnp.asarray(logits), jax.random.key(0), Sampling())
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))


def test_draws_follow_the_filtered_distribution():
    """4000 draws from one row with top-k 3 at temperature 2: only the 3 best tokens, at their tempered odds."""
    row = np.array([3.0, 2.0, 1.0, 0.5, -1.0], np.float32)
    logits = jnp.asarray(np.tile(row, (4000, 1)))
    got = np.asarray(next_token(logits, jax.random.key(3), Sampling(temperature=2.0, top_k=3)))
    want = np.exp(row[:3] / 2) / np.exp(row[:3] / 2).sum()
    counts = np.bincount(got, minlength=5) / len(got)
    assert counts[3:].sum() == 0
    np.testing.assert_allclose(counts[:3], want, atol=0.03)


def test_same_key_same_tokens(logits):
    s = Sampling(temperature=0.8, top_p=0.9)
    a = next_token(jnp.asarray(logits), jax.random.key(7), s)
    b = next_token(jnp.asarray(logits), jax.random.key(7), s)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs, key", [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"),
                                         ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_settings_are_one_line_errors(kwargs, key):
    with pytest.raises(ConfigError, match=key) as err:
        Sampling(**kwargs)
    assert "\n" not in str(err.value)


def test_buckets_and_left_padding():
    assert [bucket(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]
    assert [batch_bucket(n, 8) for n in (1, 3, 8, 9)] == [8, 8, 8, 16] and batch_bucket(5, 6) == 12
    tokens, starts = left_pad([[5, 6], [7, 8, 9]], 4, 0)
    np.testing.assert_array_equal(tokens, [[0, 0, 5, 6], [0, 7, 8, 9]])
    np.testing.assert_array_equal(starts, [2, 1])


def test_completion_lengths_count_to_the_first_stop():
    tokens = jnp.asarray([[4, 2, 9, 9], [4, 4, 4, 4], [2, 0, 0, 0]])
    got = completion_lengths(tokens, jnp.asarray([2]), 4)
    np.testing.assert_array_equal(np.asarray(got), [2, 4, 1])
