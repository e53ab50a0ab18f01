"""Shared helpers of the kernel tests: per-dtype tolerances, a relative max-error check and attention inputs."""
import jax
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


def attention_inputs(b, t, n, kv, h, dtype, segments, seed):
    """Random q [B,T,N,H], k / v [B,T,K,H] in `dtype`, an fp32 output cotangent and, with `segments`, packed
    segment ids (boundaries at random positions)."""
    k = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(k[0], (b, t, n, h), jnp.float32).astype(dtype)
    key = jax.random.normal(k[1], (b, t, kv, h), jnp.float32).astype(dtype)
    v = jax.random.normal(k[2], (b, t, kv, h), jnp.float32).astype(dtype)
    ct = jax.random.normal(k[3], (b, t, n, h), jnp.float32)
    seg = None
    if segments:
        seg = jnp.cumsum(jax.random.bernoulli(k[4], 0.15, (b, t)), axis=1).astype(jnp.int32)
    return q, key, v, ct, seg


LLAMA3_LOSS_SHAPE = (8192, 4096, 128256)  # tokens, hidden, vocab


def compile_loss_for_h100(linear_cross_entropy, shape=LLAMA3_LOSS_SHAPE):
    """Deviceless sm_90 compile of loss + grads of h and W in bf16; returns XLA's memory analysis."""
    import jax

    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    t, d, v = shape
    args = (jax.ShapeDtypeStruct((t, d), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((d, v), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((t,), jnp.int32, sharding=sharding))
    step = lambda h, w, l: jax.value_and_grad(lambda h, w: linear_cross_entropy(h, w, l)[0], (0, 1))(h, w)
    return compile_abstract(step, *args).memory_analysis()

