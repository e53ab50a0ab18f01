"""whole_update (jaxmem.optim.host_update) is layerwise_update's step over whole tensors: the same new params,
state, master weights, norm and finite flag, with the clip active, with fp16-style skipping of a non-finite
step, with the low-bit optimizer, and under XLA host compute as jaxmem.core.offload.run_update runs it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.loader import load_config
from jaxmem.core import offload
from jaxmem.optim import choice, layerwise
from jaxmem.optim import adamw_lowbit, codes, fused_host, host_update

SHAPES = {"embed": (64, 96), "final_norm": (96,), "layers": {"attn_norm": (3, 96), "wq": (3, 96, 128),
                                                            "w_down": (3, 256, 96)}}
CFG = ["optimizer.warmup_steps=0", "optimizer.lr=1e-2", "precision.param_dtype=bfloat16",
       "precision.master_weights=true"]


def _tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s), jnp.float32), SHAPES,
                        is_leaf=lambda x: isinstance(x, tuple))


def _both(opt, grads, state, weights, params, scale, skip, fused=None):
    kw = dict(clip_norm=0.5, param_dtype=jnp.bfloat16, skip_nonfinite=skip)
    want = jax.jit(functools.partial(layerwise.layerwise_update, opt, **kw))(grads, state, weights, params, scale)
    got = jax.jit(functools.partial(host_update.whole_update, opt, fused=fused, **kw))(grads, state, weights, params,
                                                                                      scale)
    return got, want


def _same_state(a, b):
    """fp32 moments within rounding; codes the same but where a last-bit difference crosses a code boundary."""
    if codes.is_quantized(a):
        np.testing.assert_allclose(a.scales, b.scales, rtol=1e-5)
        assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) < 1e-3
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def _fused(cfg):
    return fused_host.FusedAdamW.from_config(cfg)


@pytest.mark.parametrize("bits", [None, 8, "fused"])
def test_equals_layerwise(bits):
    """Two clipped steps (the gradient norm is above clip_norm) from the same state agree; the low-bit state
    agrees to a code step where the last-bit difference of the clip crosses a code boundary. Through the
    one-pass kernel (fused) too: the same state tree, counts and values up to fp32 rounding."""
    cfg = load_config("configs/tiny.yaml", CFG)
    opt = choice.make_optimizer(cfg) if bits in (None, "fused") else adamw_lowbit.make_lowbit_adamw(
        cfg, f"int{bits}", threshold=1024)
    fused = _fused(cfg) if bits == "fused" else None
    weights = _tree(0)
    state = layerwise.init_opt_state(opt, weights)
    for seed in (1, 2):
        got, want = _both(opt, _tree(seed, 0.1), state, weights, None, jnp.float32(1.0), False, fused)
        assert jax.tree.structure(got[1]) == jax.tree.structure(want[1])
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b) if a.dtype == jnp.int32 else None,
                     got[1], want[1])  # Adam's and the schedule's step counts
        assert float(want[3][0]) > 0.5
        np.testing.assert_allclose(got[3][0], want[3][0], rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got[2], want[2])
        assert np.mean(np.asarray(got[0]["layers"]["wq"] != want[0]["layers"]["wq"])) < 1e-3  # bf16 ties
        jax.tree.map(_same_state, got[1], want[1], is_leaf=codes.is_quantized)
        state, weights = want[1], want[2]


@pytest.mark.parametrize("fused", [False, True])
def test_skips_nonfinite_step(fused):
    """With skip_nonfinite, an inf in one layer's gradient keeps every old value, as layerwise_update does;
    a finite step with a loss scale divides it out. Through the one-pass kernel too."""
    cfg = load_config("configs/tiny.yaml", CFG)
    opt, fused = choice.make_optimizer(cfg), _fused(cfg) if fused else None
    weights = _tree(0)
    state = layerwise.init_opt_state(opt, weights)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), weights)
    bad = _tree(1, 0.1)
    bad["layers"]["wq"] = bad["layers"]["wq"].at[1, 2, 3].set(jnp.inf)
    got, want = _both(opt, bad, state, weights, params, jnp.float32(1.0), True, fused)
    assert not bool(got[3][1]) and not bool(want[3][1])
    jax.tree.map(np.testing.assert_array_equal, got[:3], (params, state, weights))
    got, want = _both(opt, _tree(2, 128.0), state, weights, params, jnp.float32(1024.0), True, fused)
    assert bool(got[3][1])
    np.testing.assert_allclose(got[3][0], want[3][0], rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got[2], want[2])


@pytest.mark.parametrize("bits", [None, 8, 4, "fused"])
def test_under_host_compute(bits):
    """offload.run_update's host path (compat.host_compute, state in pinned host memory) runs whole_update, the
    low-bit optimizer too, and gives what it gives on the device."""
    cfg = load_config("configs/tiny.yaml", CFG + ["offload.optimizer=host", "offload.optimizer_update=host"])
    opt = choice.make_optimizer(cfg) if bits in (None, "fused") else adamw_lowbit.make_lowbit_adamw(
        cfg, f"int{bits}", threshold=1024)
    weights, grads = _tree(0), _tree(1, 0.1)
    state = layerwise.init_opt_state(opt, weights)
    update = functools.partial(host_update.whole_update, opt, clip_norm=0.5, param_dtype=jnp.bfloat16,
                               skip_nonfinite=False, fused=_fused(cfg) if bits == "fused" else None)
    device = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_host = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, host if x.ndim else jax.sharding.SingleDeviceSharding(device)), t)
    got = jax.jit(lambda g, s, w: offload.run_update(cfg, update, g, s, w, None, jnp.float32(1.0)))(
        grads, on_host(state), on_host(weights))
    want = jax.jit(update)(grads, state, weights, None, jnp.float32(1.0))
    assert got[2]["layers"]["wq"].sharding.memory_kind == "pinned_host"
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-6, atol=1e-7), got, want)
