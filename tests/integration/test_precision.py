"""Precision levers: fp16 dynamic loss scaling (skip, back-off, growth, checkpointed), moment / master /
gradient-reduction dtypes."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config import ConfigError, LossScaleConfig

from jaxmem.loader import load_config
from jaxmem.core.precision import all_finite, init_loss_scale, update_loss_scale
from jaxmem.registry import build_program

TINY = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=16", "train.micro_batch=2", "parallel.fsdp=2",
        "optimizer.warmup_steps=0", "optimizer.lr=1e-2"]
FP16 = ["precision.param_dtype=float16", "precision.compute_dtype=float16", "precision.master_weights=true",
        "precision.loss_scale.enabled=true"]


def _program(overrides):
    return build_program(load_config(None, TINY + overrides), devices=jax.devices()[:2])


def _tokens(prog):
    return prog.shard_batch(np.random.RandomState(0).randint(0, 256, prog.batch_shape).astype(np.int32))


def test_loss_scale_rule():
    cfg = LossScaleConfig(enabled=True, init_scale=1024.0, growth_interval=3, growth_factor=2.0,
                          backoff_factor=0.5, min_scale=1.0)
    s = init_loss_scale(cfg)
    s = update_loss_scale(s, jnp.bool_(False), cfg)
    assert float(s["scale"]) == 512.0 and int(s["good_steps"]) == 0
    for expected_good in (1, 2):
        s = update_loss_scale(s, jnp.bool_(True), cfg)
        assert float(s["scale"]) == 512.0 and int(s["good_steps"]) == expected_good
    s = update_loss_scale(s, jnp.bool_(True), cfg)  # third good step in a row: grow, restart the count
    assert float(s["scale"]) == 1024.0 and int(s["good_steps"]) == 0
    low = {"scale": jnp.float32(1.0), "good_steps": jnp.int32(5)}
    assert float(update_loss_scale(low, jnp.bool_(False), cfg)["scale"]) == 1.0  # never below min_scale
    assert not bool(all_finite({"a": jnp.array([1.0, jnp.inf]), "b": jnp.ones(2)}))
    assert bool(all_finite({"a": jnp.ones(3)}))


def test_fp16_overflow_skips_the_update_and_backs_off_then_grows():
    # 2^100 overflows fp16 gradients for sure; the back-off lands on 2^7, which does not.
    prog = _program(FP16 + [f"precision.loss_scale.init_scale={2.0**100}",
                            f"precision.loss_scale.backoff_factor={2.0**-93}",
                            "precision.loss_scale.growth_interval=2", "precision.loss_scale.growth_factor=2"])
    assert set(prog.abstract_state) == {"step", "params", "opt", "master", "loss_scale"}
    state = prog.init_state()
    before = jax.tree.map(np.asarray, {k: state[k] for k in ("params", "opt", "master")})
    step, batch = prog.jit_step(), _tokens(prog)

    state, m = step(state, batch)
    assert bool(m["update_skipped"]) and float(m["loss_scale"]) == 2.0**100
    for k in before:  # nothing moved: params, master, m, v and Adam's count
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state[k]), before[k])
    assert float(state["loss_scale"]["scale"]) == 128.0
    assert int(state["loss_scale"]["good_steps"]) == 0

    losses = []
    for _ in range(4):
        state, m = step(state, batch)
        assert not bool(m["update_skipped"])
        losses.append(float(m["loss"]))
    assert float(state["loss_scale"]["scale"]) == 512.0  # grew twice: growth_interval 2, four good steps
    assert losses[-1] < losses[0]
    assert state["params"]["embed"].dtype == jnp.float16 and state["master"]["embed"].dtype == jnp.float32
    assert not np.array_equal(np.asarray(state["master"]["embed"]), before["master"]["embed"])


def test_loss_scale_state_is_checkpointed(tmp_path):
    from jaxmem.core.checkpoint import Checkpoints

    prog = _program(FP16 + [f"precision.loss_scale.init_scale={2.0**100}", "precision.loss_scale.backoff_factor=0.25"])
    state, _ = prog.jit_step()(prog.init_state(), _tokens(prog))
    ckpts = Checkpoints(tmp_path, async_save=False)
    ckpts.save(1, state, {"step": 1})
    ckpts.wait()
    restored, _ = ckpts.restore(prog.abstract_state)
    ckpts.close()
    assert float(restored["loss_scale"]["scale"]) == float(state["loss_scale"]["scale"]) == 2.0**98
    assert int(restored["loss_scale"]["good_steps"]) == 0


def test_loss_scale_needs_fp16():
    with pytest.raises(ConfigError, match="precision.loss_scale.enabled"):
        load_config(None, ["precision.loss_scale.enabled=true", "precision.compute_dtype=bfloat16"])


def test_state_dtypes_follow_the_precision_config():
    prog = _program(["precision.param_dtype=bfloat16", "precision.master_weights=true",
                     "precision.moment_dtype=bfloat16"])
    a = prog.abstract_state
    assert {x.dtype for x in jax.tree.leaves(a["params"])} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(a["master"])} == {jnp.dtype(jnp.float32)}
    adam = next(s for s in jax.tree.leaves(a["opt"], is_leaf=lambda s: hasattr(s, "nu")) if hasattr(s, "nu"))
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.bfloat16)}

    fp32 = _program(["precision.param_dtype=float32", "precision.master_weights=true"]).abstract_state
    assert "master" not in fp32  # fp32 params are their own master copy
    adam = next(s for s in jax.tree.leaves(fp32["opt"], is_leaf=lambda s: hasattr(s, "nu")) if hasattr(s, "nu"))
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}
    no_master = _program(["precision.param_dtype=bfloat16"]).abstract_state
    assert "master" not in no_master


def test_bf16_moments_train_like_fp32_moments():
    def run(extra):
        prog = _program(["precision.master_weights=true"] + extra)
        state, step, batch = prog.init_state(), prog.jit_step(), _tokens(prog)
        losses = []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return state, losses

    s32, l32 = run([])
    s16, l16 = run(["precision.moment_dtype=bfloat16"])
    adam = next(s for s in jax.tree.leaves(s16["opt"]["rest"], is_leaf=lambda s: hasattr(s, "nu"))
                if hasattr(s, "nu"))
    assert adam.nu["embed"].dtype == jnp.bfloat16
    assert l16[-1] < l16[0]
    np.testing.assert_allclose(l16, l32, rtol=2e-2)


def _reduced_bytes(hlo: str) -> dict[str, int]:
    """Bytes per element type that cross-device reductions (reduce-scatter, all-reduce) produce."""
    sizes = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2}
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*%\S+ = (.*?) (reduce-scatter|all-reduce)(-start)?\(", line)
        if not m:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        if m.group(3):  # an async start's tuple holds (operands, results): count the results only
            shapes = shapes[len(shapes) // 2:]
        for dtype, dims in shapes:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out[dtype] = out.get(dtype, 0) + n * sizes.get(dtype, 0)
    return out


@pytest.mark.slow
def test_grad_reduce_dtype_reaches_the_compiled_collectives():
    """On an 8 x H100 deviceless compile: bf16 reduction moves gradient bytes from f32 to bf16 collectives.

    (Layer weights are reduce-scattered in the compute dtype either way: XLA all-gathers them after
    their cast to bf16, so their gradients come back in bf16; the embedding and LM head follow the lever.)
    """
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime import aot

    def reduced(dtype):
        cfg = load_config(None, ["model.preset=tiny", "model.n_layers=2", "train.seq_len=64", "parallel.fsdp=8",
                                 "precision.param_dtype=float32", "precision.compute_dtype=bfloat16",
                                 f"precision.grad_reduce_dtype={dtype}"])
        prog = build_program(cfg, devices=aot.target_devices("h100-80g", 8))
        return _reduced_bytes(prog.lower().compile().as_text())

    f32, bf16 = reduced("float32"), reduced("bfloat16")
    assert bf16.get("f32", 0) < f32.get("f32", 0), (f32, bf16)
    assert bf16.get("bf16", 0) > f32.get("bf16", 0), (f32, bf16)
