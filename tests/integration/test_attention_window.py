"""Sliding-window attention: every kernel's windowed output and gradients against the pure-jnp reference,
and the reference against a numpy loop (a query sees the keys less than `window` positions back)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.kernels.attention.config import AttentionBlocks
from jaxmem.kernels.attention.pallas import flash_attention, score_pairs
from jaxmem.kernels.attention.reference import attention_reference


def _qkv(b=2, t=75, n=4, kv=2, h=16, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32)
    k = jax.random.normal(keys[1], (b, t, kv, h), jnp.float32)
    v = jax.random.normal(keys[2], (b, t, kv, h), jnp.float32)
    return q, k, v


def _numpy_window_attention(q, k, v, window, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros_like(q)
    for i in range(t):
        lo = max(0, i - window + 1)
        for head in range(n):
            s = np.einsum("bh,bsh->bs", q[:, i, head], k[:, lo:i + 1, head // group]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, i, head] = np.einsum("bs,bsh->bh", p, v[:, lo:i + 1, head // group])
    return out


@pytest.mark.parametrize("window", [1, 7, 33])
def test_reference_window_matches_numpy(window):
    q, k, v = _qkv(b=1, t=41)
    got = attention_reference(q, k, v, window=window, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), _numpy_window_attention(q, k, v, window, 0.3), atol=2e-5)


def test_window_longer_than_sequence_is_full_causal():
    q, k, v = _qkv(t=40)
    np.testing.assert_allclose(attention_reference(q, k, v, window=40), attention_reference(q, k, v), atol=1e-6)
    assert not np.allclose(attention_reference(q, k, v, window=5), attention_reference(q, k, v), atol=1e-3)


@pytest.mark.parametrize("window,seg", [(5, False), (20, False), (37, True), (64, False)])
def test_pallas_window_forward_and_vjp_match_reference(window, seg):
    """Interpret mode; blocks of 16 over T=75 (padded to 80): windows shorter than, across and beyond a block."""
    q, k, v = _qkv()
    segment_ids = None
    if seg:
        segment_ids = jnp.asarray(np.repeat(np.array([[0, 1, 2], [3, 3, 4]]), [30, 25, 20], axis=1), jnp.int32)
    blocks = AttentionBlocks(block_q=16, block_k=16)
    cot = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v) * cot)

    ref = lambda q, k, v: attention_reference(q, k, v, segment_ids_bt=segment_ids, window=window, scale=0.2)  # noqa
    got = lambda q, k, v: flash_attention(q, k, v, segment_ids, blocks=blocks, window=window, scale=0.2,  # noqa
                                          interpret=True)
    np.testing.assert_allclose(got(q, k, v), ref(q, k, v), atol=2e-5, rtol=1e-5)
    g_ref = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: loss(got, *a), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_got, g_ref):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4)


def test_pallas_window_skips_blocks_in_its_cost_estimate():
    """The cost estimate the kernel hands XLA counts only the band's scores."""
    assert score_pairs(8192, 8192) == 8192 * 8192 / 2
    assert score_pairs(8192, 8192, window=1024) == 8192 * 1024 - 1024 * 1023 / 2
    assert score_pairs(100, 100, window=400) == score_pairs(100, 100)


def test_pallas_window_visits_only_band_blocks():
    """The kernel's loop bounds: query block i visits key blocks [first, last) covering exactly its band."""
    from jaxmem.kernels.attention.pallas import _first_key_block, _key_blocks, _query_blocks_end

    bq = bk = 16
    n = 8
    for window in (1, 5, 16, 17, 40):
        for i in range(n):
            lo, hi = int(_first_key_block(i, bq, bk, window)), int(_key_blocks(i, n, bq, bk, True))
            needed = {kpos // bk for qpos in range(i * bq, (i + 1) * bq)
                      for kpos in range(max(0, qpos - window + 1), qpos + 1)}
            assert set(range(lo, hi)) == needed
        for j in range(n):
            lo, hi = (j * bk) // bq, int(_query_blocks_end(j, n, bq, bk, window))
            needed = {qpos // bq for kpos in range(j * bk, (j + 1) * bk)
                      for qpos in range(kpos, min(n * bq, kpos + window))}
            assert set(range(lo, hi)) == needed


def test_pallas_window_compiles_for_h100_gemma3_shape():
    """Deviceless sm_90 compile of a windowed fwd+bwd at Gemma 3 12B head shape (16 q / 8 kv heads, head_dim
    256, window 1024, seq 4096): the block-skipping loop bounds lower through Triton."""
    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    spec = lambda n: jax.ShapeDtypeStruct((1, 4096, n, 256), jnp.bfloat16, sharding=sharding)  # noqa: E731

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, window=1024), q, k, v)
        return vjp(out)

    compiled = compile_abstract(fwd_bwd, spec(16), spec(8), spec(8))
    assert compiled.memory_analysis().temp_size_in_bytes < 0.25 * 2**30
    assert "flash_attention_fwd" in compiled.as_text() or "triton" in compiled.as_text().lower()


@pytest.mark.parametrize("window", [1, 6, 30])
def test_cudnn_window_argument_means_the_same_window(window):
    """The (left, right) window cudnn_attention hands jax.nn.dot_product_attention, run through that API's
    XLA implementation (same argument, CPU), equals the reference's window."""
    from jaxmem.kernels.attention.cudnn import local_window_size

    q, k, v = _qkv(t=40)
    got = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla", scale=0.3,
                                       local_window_size=local_window_size(window))
    np.testing.assert_allclose(got, attention_reference(q, k, v, window=window, scale=0.3), atol=2e-5)
