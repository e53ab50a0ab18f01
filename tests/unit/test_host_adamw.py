"""The one-pass host AdamW kernel (jaxmem.kernels.host_adamw) against its jnp reference, its build cache, and the
choice of the fused update (jaxmem.optim.fused_host.choose): where it runs, and the one-line errors where an
explicit kernels.host_update=fused cannot."""
import dataclasses
import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config.schema import ConfigError
from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.kernels.host_adamw import build, host_adamw, host_adamw_lowbit, host_adamw_reference, lowbit_tables
from jaxmem.optim import fused_host
from jaxmem.train import run

from tiny_config import tiny_config

HYPER = dict(b1=0.9, b2=0.95, eps=1e-8)


def _inputs(shape, grad_dtype, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda scale: jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return (draw(1e-2).astype(grad_dtype), draw(1.0), draw(1e-3), jnp.abs(draw(1e-5)))


def _close(a, b):
    """Equal up to fp32 rounding: relative to each value, and to the tensor's largest where terms cancel."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.parametrize("shape", [(7,), (3, 70_001), (1_000_003,)])  # one piece; several, with a ragged end
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_matches_reference(shape, grad_dtype, decay):
    """Three steps with a clip multiplier and bias corrections: weights and moments equal the jnp reference's
    up to fp32 rounding (multiply-add contraction, the order of the reciprocals), the bf16 params are the
    rounding of the kernel's own weights, bit for bit."""
    g, w, m, v = _inputs(shape, grad_dtype)
    kernel = jax.jit(functools.partial(host_adamw, decay=decay, **HYPER))
    reference = jax.jit(functools.partial(host_adamw_reference, decay=decay, **HYPER))
    want = (w, m, v)
    for t in (1, 2, 3):
        scalars = jnp.array([1e-2 / t, 1 - 0.9 ** t, 1 - 0.95 ** t, 0.7, 0.0], jnp.float32)
        got = kernel(g, w, m, v, scalars)
        want = reference(g, *want[:3], scalars)
        for a, b in zip(got[:3], want[:3]):
            _close(a, b)
        np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(got[0].astype(jnp.bfloat16)))
        w, m, v = got[:3]
    assert float(jnp.max(jnp.abs(w - _inputs(shape, grad_dtype)[1]))) > 1e-3  # the weights moved


LOWBIT = {8: ("dynamic8_signed", "dynamic8_unsigned", 2048), 4: ("dynamic4_signed", "linear_square4", 128)}


def _lowbit_codes(bits):
    """(m's code name, v's, the block, v's Code, the kernel's tables) of the `bits` state kind."""
    from jaxmem.optim import codes

    m_name, v_name, block = LOWBIT[bits]
    m_code, v_code = codes.CODES[m_name], codes.CODES[v_name]
    return m_name, v_name, block, v_code, lowbit_tables(m_code, v_code)


@pytest.mark.parametrize("bits,shape,grad_dtype", [(8, (64, 4096), jnp.float32), (8, (3, 70_001), jnp.bfloat16),
                                                    (4, (64, 1000), jnp.bfloat16), (4, (5, 7, 129), jnp.float32)])
def test_lowbit_matches_dequantize_step_quantize(bits, shape, grad_dtype):
    """Block-quantized moments (several blocks a row, a ragged last block, an odd 4-bit row): three steps
    through the kernel against codes.dequantize, the jnp reference step and codes.quantize, jitted (XLA's
    contraction): the weights within fp32 rounding, the codes equal but for values that fp32 rounding moves
    across a midpoint (at most 1 in 10^4), the scales within fp32 rounding."""
    from jaxmem.optim import codes

    m_name, v_name, block, v_code, tables = _lowbit_codes(bits)
    g, w, m, v = _inputs(shape, grad_dtype)
    m, v = codes.quantize(m, m_name, block), codes.quantize(v, v_name, block)
    kernel = jax.jit(functools.partial(host_adamw_lowbit, bits=bits, length=m.block, v_sqrt_linear=v_code.sqrt_linear,
                                       decay=0.1, **HYPER))

    @jax.jit
    def reference(g, w, m, v, scalars):
        w, m_new, v_new, _ = host_adamw_reference(g, w, codes.dequantize(m), codes.dequantize(v), scalars,
                                                  decay=0.1, **HYPER)
        return w, codes.quantize(m_new, m_name, block), codes.quantize(v_new, v_name, block)

    for t in (1, 2, 3):
        scalars = jnp.array([1e-2 / t, 1 - 0.9 ** t, 1 - 0.95 ** t, 0.7, 0.0], jnp.float32)
        got = kernel(g, w, m.codes, m.scales, v.codes, v.scales, scalars, tables)
        want_w, want_m, want_v = reference(g, w, m, v, scalars)
        _close(got[0], want_w)
        np.testing.assert_array_equal(np.asarray(got[5]), np.asarray(got[0].astype(jnp.bfloat16)))
        for codes_, scales, want in ((got[1], got[2], want_m), (got[3], got[4], want_v)):
            assert np.mean(np.asarray(codes_) != np.asarray(want.codes)) <= 1e-4
            np.testing.assert_allclose(np.asarray(scales), np.asarray(want.scales), rtol=1e-6)
        w = got[0]
        m = dataclasses.replace(m, codes=got[1], scales=got[2])
        v = dataclasses.replace(v, codes=got[3], scales=got[4])
    assert float(jnp.max(jnp.abs(codes.dequantize(m)))) > 0 and len(np.unique(np.asarray(m.codes))) > 4


@pytest.mark.parametrize("bits", [8, 4])
def test_lowbit_block_with_a_nan_gets_a_nan_scale_and_leaves_the_others(bits):
    """A NaN gradient value (at a block's end, where the extremes' vector lanes end) makes that block's m and v
    scales NaN (numpy's max of the block; XLA:CPU's vectorized max in codes.quantize can return -inf there, so
    that block is left out of the comparison); every other block's codes and scales are the reference's."""
    from jaxmem.optim import codes

    m_name, v_name, block, v_code, tables = _lowbit_codes(bits)
    g, w, m, v = _inputs((4, 3 * block + 5), jnp.float32, seed=3)
    g = g.at[1, 2 * block - 1].set(jnp.nan)
    m, v = codes.quantize(m, m_name, block), codes.quantize(v, v_name, block)
    scalars = jnp.array([1e-2, 0.1, 0.05, 1.0, 0.0], jnp.float32)
    got = host_adamw_lowbit(g, w, m.codes, m.scales, v.codes, v.scales, scalars, tables, bits=bits, length=block,
                            v_sqrt_linear=v_code.sqrt_linear, decay=0.1, **HYPER)
    _, m_ref, v_ref, _ = host_adamw_reference(g, w, codes.dequantize(m), codes.dequantize(v), scalars, decay=0.1,
                                              **HYPER)
    for codes_, scales, want in ((got[1], got[2], codes.quantize(m_ref, m_name, block)),
                                 (got[3], got[4], codes.quantize(v_ref, v_name, block))):
        scales, want_scales = np.asarray(scales), np.asarray(want.scales)
        others = np.ones(scales.shape, bool)
        others[1, 1] = False
        assert np.isnan(scales[1, 1]) and np.isfinite(scales[others]).all()
        np.testing.assert_allclose(scales[others], want_scales[others], rtol=1e-6)
        block_bytes = block if bits == 8 else block // 2
        kept = np.ones(np.asarray(codes_).shape, bool)
        kept[1, block_bytes:2 * block_bytes] = False
        assert np.mean(np.asarray(codes_)[kept] != np.asarray(want.codes)[kept]) <= 1e-4


def test_skip_keeps_state_and_rounds_old_weights():
    g, w, m, v = _inputs((200_000,), jnp.float32)
    g = g.at[5].set(jnp.inf)
    scalars = jnp.array([1e-2, 0.1, 0.05, 1.0, 1.0], jnp.float32)
    got = jax.jit(functools.partial(host_adamw, decay=0.1, **HYPER))(g, w, m, v, scalars)
    for a, b in zip(got, (w, m, v, w.astype(jnp.bfloat16))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("threads", ["1", "3"])
def test_threads_of_its_own_give_the_pool_s_result(threads, monkeypatch):
    """Without XLA's intra-op pool (a GPU plugin's host program may pass none) the kernel splits the tensor
    over threads of its own (JAXMEM_HOST_ADAMW_THREADS forces them here): the same values bit for bit."""
    g, w, m, v = _inputs((1_000_003,), jnp.bfloat16)
    scalars = jnp.array([1e-2, 0.1, 0.05, 0.7, 0.0], jnp.float32)
    kernel = jax.jit(functools.partial(host_adamw, decay=0.1, **HYPER))
    pooled = kernel(g, w, m, v, scalars)
    monkeypatch.setenv("JAXMEM_HOST_ADAMW_THREADS", threads)
    own = kernel(g, w, m, v, scalars)
    for a, b in zip(own, pooled):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(own[0]), np.asarray(w))


def test_updates_in_place_when_donated():
    """Weights and moments are written into the donated input buffers: no new host allocation per tensor."""
    g, w, m, v = _inputs((300_000,), jnp.float32)
    pointers = [x.unsafe_buffer_pointer() for x in (w, m, v)]
    step = jax.jit(functools.partial(host_adamw, decay=0.1, **HYPER), donate_argnums=(1, 2, 3))
    out = step(g, w, m, v, jnp.array([1e-2, 0.1, 0.05, 1.0, 0.0], jnp.float32))
    assert [x.unsafe_buffer_pointer() for x in out[:3]] == pointers


def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMEM_KERNEL_CACHE", str(tmp_path))
    first = build.library_path()
    stamp = first.stat().st_mtime_ns
    assert build.library_path() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_no_compiler_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(build.BuildError, match=r"no C\+\+ compiler"):
        build.library_path()


HOST = ["offload.optimizer=host", "precision.param_dtype=bfloat16", "precision.master_weights=true"]


def _choose(overrides, platform="cpu", n_devices=1):
    cfg = load_config("configs/tiny.yaml", HOST + overrides)
    return fused_host.choose(cfg, platform, n_devices, jnp.dtype(cfg.precision.param_dtype))


def test_choose(monkeypatch):
    assert isinstance(_choose([]), fused_host.FusedAdamW)
    assert _choose(["kernels.host_update=xla"]) is None
    assert _choose([], platform="gpu") is None and _choose([], n_devices=8) is None
    assert _choose(["offload.optimizer_update=device"]) is None  # the update streams through the device
    assert isinstance(_choose(["precision.moment_dtype=int8"]), fused_host.FusedAdamW)  # block-quantized too
    assert _choose(["precision.moment_dtype=bfloat16"]) is None  # auto: XLA's update for a kind it does not cover
    with pytest.raises(ConfigError, match="kernels.host_update=fused.*precision.moment_dtype=bfloat16"):
        _choose(["kernels.host_update=fused", "precision.moment_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="kernels.host_update=fused.*needs the mesh and the weights' partition"):
        _choose(["kernels.host_update=fused"], n_devices=8)
    with pytest.raises(ConfigError, match="kernels.host_update=fused.*1 tpu device"):
        _choose(["kernels.host_update=fused"], platform="tpu")

    def unbuildable():
        raise build.BuildError("no C++ compiler")

    monkeypatch.setattr(fused_host, "register", lambda platform: unbuildable())
    assert _choose([]) is None
    with pytest.raises(ConfigError, match="kernels.host_update=fused cannot run here: no C\\+\\+ compiler"):
        _choose(["kernels.host_update=fused"])


# ---------------------------------------------------------------- in the train step

SMALL = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=16", "optimizer.warmup_steps=0",
         "optimizer.lr=1e-2", "train.micro_batch=4", "checkpoint.async_save=false", "train.log_every=1"]


def _losses(tmp_path, impl, steps, moments):
    cfg = tiny_config(tmp_path, *HOST, *SMALL, f"kernels.host_update={impl}", f"train.steps={steps}",
                      "checkpoint.every=3", f"precision.moment_dtype={moments}")
    return run(cfg)


@pytest.mark.parametrize("moments,target", [("float32", build.TARGET), ("int8", build.LOWBIT_TARGET)])
def test_train_step_runs_the_kernel_and_resumes_exactly(tmp_path, moments, target):
    """A one-device CPU run with the state on the host takes the kernel by default (auto), fp32 or
    block-quantized moments: its compiled step calls it, its losses follow XLA's update within fp32 rounding,
    and a run resumed from its step-3 checkpoint gives the straight run's losses bit for bit."""
    assert jax.device_count() == 1, "the unit tier's one device (JAXMEM_TEST_DEVICES=1): run() takes every device"
    cfg = load_config(None, HOST + SMALL + [f"precision.moment_dtype={moments}"])
    prog = build_program(cfg, devices=jax.devices()[:1])
    assert prog.fused_update is not None
    batch = prog.shard_batch(np.zeros(prog.batch_shape, np.int32))
    assert f"@{target}(" in prog.jit_step().lower(prog.abstract_state, batch).as_text()
    xla = [r["loss"] for r in _losses(tmp_path / "xla", "xla", 6, moments)["records"]]
    straight = _losses(tmp_path / "fused", "auto", 6, moments)
    fused = [r["loss"] for r in straight["records"]]
    np.testing.assert_allclose(fused, xla, rtol=1e-4)
    assert fused[-1] < fused[0]
    shutil.rmtree(tmp_path / "fused" / "checkpoints" / "6")
    resumed = _losses(tmp_path / "fused", "auto", 6, moments)
    assert resumed["resumed_from"] == 3
    assert [r["loss"] for r in resumed["records"]] == fused[3:]


def test_registering_for_a_missing_plugin_is_one_line():
    from jaxmem.runtime import pjrt_ffi

    with pytest.raises(pjrt_ffi.PluginUnavailable, match="^no ROCM PJRT plugin is loaded") as e:
        pjrt_ffi.register_host_handler(build.TARGET, 0, plugin="ROCM")
    assert "\n" not in str(e.value)
