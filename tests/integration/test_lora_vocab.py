"""lora.quantize_embeddings: the frozen embedding table and LM head stored as int8 / NF4 per vocab row give the
loss and adapter gradients of the same LoRA model whose tables were dequantized by hand (numpy), the loss
dequantizes a vocab chunk at a time (overlapping last chunk included), the planner's base bytes are the
stored bytes, and bad combinations are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.core.quant import NF4_CODES, SCALE_BLOCK
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

BASE = ["train.seq_len=32", "lora.rank=4", "lora.alpha=8", "parallel.fsdp=1", "train.micro_batch=2",
        "kernels.loss=chunked", "kernels.loss_block_v=96"]  # 256 columns: chunks at 0, 96 and 160 (overlaps)


def _program(*overrides):
    return build_program(load_config("configs/tiny.yaml", BASE + list(overrides)), devices=jax.devices()[:1])


def _rows_by_hand(stored: dict, d: int) -> np.ndarray:
    """[V, D] fp32 from the stored rows, in numpy: int8 q * scale, or NF4 nibbles -> code * block absmax."""
    s = {k: np.asarray(v) for k, v in stored.items()}
    if "q" in s:
        return s["q"].astype(np.float32) * s["scale"]
    if "absmax" in s:
        absmax = s["absmax"]
    else:  # double quantized: int8 around the row's mean, an fp32 scale per SCALE_BLOCK of them
        q = s["absmax_q"].astype(np.float32)
        scale = np.repeat(s["absmax_scale"], SCALE_BLOCK, axis=1)[:, :q.shape[1]]
        absmax = q * scale + s["absmax_offset"]
    codes = s["codes"]
    idx = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
    values = np.asarray(NF4_CODES, np.float32)[idx].reshape(codes.shape[0], absmax.shape[1], -1) * absmax[..., None]
    return values.reshape(codes.shape[0], -1)[:, :d]


def _loss_and_grads(prog, adapters, base, toks):
    fn = loss_sum_fn(prog)
    return jax.jit(jax.value_and_grad(lambda a: fn(a, toks[:, :-1], toks[:, 1:], base=base)[0]))(adapters)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["lora.base_dtype=nf4", "lora.double_quant=true"], ["lora.base_dtype=int8"],
                                   ["lora.base_dtype=nf4", "model.tie_embeddings=true"]],
                         ids=["nf4_double_quant", "int8", "nf4_tied"])
def test_stored_tables_equal_tables_dequantized_by_hand(extra):
    prog = _program("lora.quantize_embeddings=true", *extra)
    ref = _program(*extra)
    state = prog.init_state()
    keys = iter(jax.random.split(jax.random.key(3), 64))
    adapters = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                            jax.device_get(state["params"]))
    base = jax.device_get(state["base"])
    d, v = prog.cfg.model.d_model, prog.cfg.model.vocab_size
    ref_base = dict(jax.device_get(ref.init_state()["base"]), layers=base["layers"])  # same targeted layers
    for key in ("embed", "lm_head"):
        if key in base:
            assert isinstance(base[key], dict) and all(x.shape[0] == v for x in jax.tree.leaves(base[key]))
            w = _rows_by_hand(base[key], d)
            ref_base[key] = (w.T if key == "lm_head" else w).astype(ref_base[key].dtype)
    toks = np.random.default_rng(0).integers(0, v, (2, 33)).astype(np.int32)
    loss, grads = _loss_and_grads(prog, adapters, base, toks)
    want_loss, want_grads = _loss_and_grads(ref, adapters, ref_base, toks)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), grads, want_grads)
    # the tables really changed: the unquantized base gives another loss
    plain, _ = _loss_and_grads(ref, adapters, dict(jax.device_get(ref.init_state()["base"]), layers=base["layers"]),
                               toks)
    assert abs(float(plain) - float(loss)) > 1e-4
    # the planner's `base` is the stored bytes, and smaller than with bf16 tables
    from jaxmem.plan.bill import compute_bill

    stored = sum(x.nbytes for x in jax.tree.leaves(base))
    assert compute_bill(prog.cfg, 1, gpu=False).device["base"] == stored
    assert compute_bill(ref.cfg, 1, gpu=False).device["base"] > stored


@pytest.mark.parametrize("overrides,fragment", [
    (["lora.base_dtype=bfloat16"], "lora.quantize_embeddings: needs lora.base_dtype int8 or nf4"),
    (["lora.base_dtype=nf4", "kernels.loss=naive"], "kernels.loss=chunked"),
    (["lora.base_dtype=nf4", "parallel.tp=2"], "lora.quantize_embeddings: needs"),
])
def test_bad_quantize_embeddings_settings_are_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", BASE + ["lora.quantize_embeddings=true"] + overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_more_than_one_device_is_refused_by_name():
    cfg = load_config("configs/tiny.yaml", [*BASE[:-3], "lora.base_dtype=nf4", "lora.quantize_embeddings=true",
                                            "kernels.loss=chunked", "parallel.fsdp=-1", "train.micro_batch=1"])
    with pytest.raises(ConfigError, match="lora.quantize_embeddings: needs one device"):
        prog = build_program(cfg, devices=jax.devices()[:2])
        loss_sum_fn(prog)(None, jnp.zeros((2, 32), jnp.int32), jnp.zeros((2, 32), jnp.int32))


def test_merge_lora_export_dequantizes_the_stored_tables():
    from jaxmem.lora.export import merged_params

    prog = _program("lora.base_dtype=nf4", "lora.double_quant=true", "lora.quantize_embeddings=true")
    state = prog.init_state()
    base, d = jax.device_get(state["base"]), prog.cfg.model.d_model
    params = merged_params(prog, state)
    np.testing.assert_allclose(np.asarray(params["embed"]), _rows_by_hand(base["embed"], d), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(params["lm_head"]), _rows_by_hand(base["lm_head"], d).T, rtol=1e-6,
                               atol=1e-7)
    assert params["embed"].shape == (prog.cfg.model.vocab_size, d)
