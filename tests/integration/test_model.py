"""The NNX decoder against a hand-written plain-JAX Llama (scripts/handwritten_step.py)."""
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxmem.loader import load_config
from jaxmem.model import init_model
from jaxmem.config.names import ALL_NAMES, MOE_NAMES, CheckpointName

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
from handwritten_step import forward  # noqa: E402


def test_logits_match_handwritten_reference():
    cfg = load_config("configs/tiny.yaml", ["model.n_layers=3", "model.rope_theta=500000"]).model
    model = init_model(cfg, seed=3)
    params = nnx.to_pure_dict(nnx.split(model)[1])
    # random norm weights so a swapped norm would show
    params["layers"]["attn_norm"] = 1 + 0.1 * jax.random.normal(jax.random.key(1), params["layers"]["attn_norm"].shape)
    model = nnx.merge(nnx.split(model)[0], params)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 37)).astype(np.int32)
    got = model(tokens)
    want = forward(params, tokens, eps=cfg.norm_eps, theta=cfg.rope_theta)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_every_checkpoint_name_is_tagged_in_the_layer():
    cfg = load_config("configs/tiny.yaml", ["model.qkv_bias=true"]).model
    model = init_model(cfg)
    jaxpr = str(jax.make_jaxpr(lambda t: model(t))(np.zeros((1, 8), np.int32)))
    # the MoE names are tagged by a mixture of experts (tests/integration/test_moe.py); flash_residuals by a Pallas flash
    # kernel (tests/unit/test_remat_alternate.py): this dense model's attention is plain XLA
    untagged = set(MOE_NAMES) | {CheckpointName.FLASH_RESIDUALS.value}
    for name in ALL_NAMES:
        assert (f"name={name}" in jaxpr) == (name not in untagged), name


def test_the_late_zeros_lookup_is_take_with_its_zeros_made_after_the_cotangent():
    """take_rows_late_zeros is jnp.take along the rows, gradient included (repeated and out-of-order ids, bf16
    and fp32); in its backward the scatter target's zeros come out of a barrier that waits for the cotangent.
    A program on a mesh uses it, one on a single device the plain lookup."""
    import jax.numpy as jnp

    from jaxmem.registry import build_program
    from jaxmem.model.transformer import take_rows, take_rows_late_zeros

    ids = jnp.array([[1, 3, 3, 49], [0, 0, 7, 2]])
    weights = jnp.arange(8, dtype=jnp.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        table = jax.random.normal(jax.random.key(0), (50, 8)).astype(dtype)
        ours = jax.value_and_grad(lambda t: (jnp.sin(take_rows_late_zeros(t, ids)) * weights).sum())(table)
        take = jax.value_and_grad(lambda t: (jnp.sin(jnp.take(t, ids, axis=0)) * weights).sum())(table)
        np.testing.assert_array_equal(np.asarray(ours[0], np.float32), np.asarray(take[0], np.float32))
        np.testing.assert_array_equal(np.asarray(ours[1], np.float32), np.asarray(take[1], np.float32))
        assert ours[1].dtype == dtype
    text = str(jax.make_jaxpr(jax.grad(lambda t: take_rows_late_zeros(t, ids).sum()))(table))
    assert "optimization_barrier" in text and "scatter-add" in text
    mesh = build_program(load_config("configs/tiny.yaml", ["parallel.fsdp=8"]), devices=jax.devices())
    one = build_program(load_config("configs/tiny.yaml", ["parallel.fsdp=1"]), devices=jax.devices()[:1])
    assert mesh.ctx.lookup is take_rows_late_zeros and one.ctx.lookup is take_rows
