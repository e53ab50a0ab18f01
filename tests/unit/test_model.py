"""The NNX decoder against a hand-written plain-JAX Llama (scripts/handwritten_step.py)."""
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxmem.config import load_config
from jaxmem.model import init_model
from jaxmem.model.names import ALL_NAMES, MOE_NAMES, CheckpointName

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
    # the MoE names are tagged by a mixture of experts (tests/unit/test_moe.py); flash_residuals by a Pallas flash
    # kernel (tests/unit/test_remat_alternate.py): this dense model's attention is plain XLA
    untagged = set(MOE_NAMES) | {CheckpointName.FLASH_RESIDUALS.value}
    for name in ALL_NAMES:
        assert (f"name={name}" in jaxpr) == (name not in untagged), name
