"""The tiny Qwen3, Gemma 3 and gpt-oss configs train on the CPU mesh (fsdp, and fsdp x tp) like one device."""
import functools

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.registry import build_program

BASE = ["train.seq_len=32", "train.micro_batch=1", "optimizer.warmup_steps=0", "optimizer.lr=3e-3"]
STEPS = 4


def _run(config, overrides, devices, rows=8):
    cfg = load_config(config, BASE + overrides)
    prog = build_program(cfg, devices=devices)
    assert prog.grad_accum * prog.rows == rows
    state, step = prog.init_state(), prog.jit_step()
    losses = []
    for i in range(STEPS):
        toks = np.random.default_rng(0).integers(0, 256, size=(rows, cfg.train.seq_len + 1)).astype(np.int32)
        state, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
        losses.append(float(m["loss"]))
    return losses


@functools.cache
def _one_device(config):
    """The single-device XLA losses of a family, shared by the mesh and the Pallas kernel tests."""
    return _run(config, ["parallel.fsdp=1", "train.micro_batch=8"], jax.devices()[:1])


LAYOUTS = {"fsdp8": ["parallel.fsdp=8"],
           "fsdp4_tp2": ["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp", "train.micro_batch=2"]}


# Each family on the layouts the Pallas tests below do not train it on: Gemma 3 under the fsdp rules is the
# sp=2 x fsdp=4 test's (its params split like fsdp=8's, over 4), gpt-oss on fsdp=4 x tp=2 the sink kernel test's
# (the same layout with the Pallas kernel; XLA's attention on that layout is Qwen3's and Gemma 3's here).
FAMILY_LAYOUTS = {"qwen3": ("fsdp8", "fsdp4_tp2"), "gemma3": ("fsdp4_tp2",), "gpt-oss": ("fsdp8",)}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILY_LAYOUTS))
def test_tiny_family_trains_on_the_mesh_like_one_device(family):
    config = f"configs/tiny-{family}.yaml"
    single = _one_device(config)
    assert single[-1] < single[0] - 0.1, single  # one batch, seen again: the loss falls
    for name in FAMILY_LAYOUTS[family]:
        overrides = LAYOUTS[name]
        np.testing.assert_allclose(_run(config, overrides, jax.devices()), single, rtol=2e-5, err_msg=name)


def test_gemma3_window_shorter_than_the_sequence():
    cfg = load_config("configs/tiny-gemma3.yaml", BASE)
    assert cfg.model.sliding_window < cfg.train.seq_len and cfg.model.n_layers > cfg.model.global_every


@pytest.mark.parametrize("overrides,key", [
    (["model.global_every=6", "model.sliding_window=0"], "model.global_every"),
    (["model.sliding_window=-1"], "model.sliding_window"),
    (["model.rope_scaling={rope_type: dynamic, factor: 2}"], "model.rope_scaling.rope_type"),
    (["model.rope_scaling={rope_type: yarn, factor: 2}"], "model.rope_scaling.original_max_position_embeddings"),
    (["model.moe_biases=true"], "model.moe_biases"),
    (["model.preset=tiny-gpt-oss", "kernels.attention=cudnn"], "kernels.attention"),
    (["model.preset=tiny-gpt-oss", "model.rope_local_theta=10000"], "model.rope_local_theta"),
    (["model.preset=tiny-gpt-oss", "parallel.ep=2"], "model.moe_biases"),
    (["parallel.pp=2", "train.grad_accum=2"], "model.global_every"),
    (["lora.rank=4", "lora.quantize_embeddings=true", "lora.base_dtype=nf4", "kernels.loss=chunked",
      "parallel.fsdp=1"], "lora.quantize_embeddings"),
])
def test_bad_layer_kind_settings_are_one_line_errors(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config("configs/tiny-gemma3.yaml", overrides)
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_gemma3_sequence_parallel_with_the_windowed_pallas_kernel_matches_one_device():
    """sp=2 x fsdp=4 (Ulysses all-to-alls around the layer-kind cond) with the windowed Pallas kernel
    (interpret mode) and selective remat: the single-device XLA losses."""
    config = "configs/tiny-gemma3.yaml"
    single = _one_device(config)
    sp = _run(config, ["parallel.sp=2", "parallel.fsdp=4", "train.micro_batch=2", "kernels.attention=pallas",
                       "remat.preset=selective"], jax.devices())
    np.testing.assert_allclose(sp, single, rtol=2e-5)


@pytest.mark.slow
def test_gpt_oss_with_the_pallas_sink_kernel_matches_one_device():
    """fsdp 4 x tp 2 with the Pallas flash kernel (interpret mode; the sinks split with the heads, the windowed
    and global layers through the layer-kind cond) and full remat: the single-device XLA losses."""
    config = "configs/tiny-gpt-oss.yaml"
    single = _one_device(config)
    pallas = _run(config, LAYOUTS["fsdp4_tp2"] + ["kernels.attention=pallas", "remat.preset=full"], jax.devices())
    np.testing.assert_allclose(pallas, single, rtol=2e-5)
