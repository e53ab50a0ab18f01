"""The `alternate_matmuls` preset (torchtitan's op-level selective class): what it keeps, that the flash kernel's
forward does not rerun in the backward, and that the recompute is exactly the k, output and up projections."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxmem.core import remat
from jaxmem.config import RematConfig
from jaxmem.loader import load_config
from jaxmem.kernels.attention.pallas import flash_attention
from jaxmem.plan.costmodel import recompute_flops_per_layer

Q = jax.random.normal(jax.random.PRNGKey(0), (1, 64, 2, 16))
K = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 1, 16))
V = jax.random.normal(jax.random.PRNGKey(2), (1, 64, 1, 16))


def _attention_loss(q, k, v):
    q = checkpoint_name(q * 1.5, "query_proj")
    out = checkpoint_name(flash_attention(q, k, v, interpret=True), "attn_context")
    return jnp.sum(jnp.sin(out))


def _grad(preset: str):
    fn = _attention_loss if preset == "none" else jax.checkpoint(
        _attention_loss, policy=remat.policy(RematConfig(preset=preset)))
    return jax.jit(jax.grad(fn, argnums=(0, 1, 2)))


def _forward_reruns(preset: str) -> int:
    """Loops of the flash forward kernel that run again inside the backward (the rematted computation)."""
    text = _grad(preset).lower(Q, K, V).compile().as_text()
    return sum(" while(" in line and "rematted_computation/flash_attention_fwd/while\"" in line
               for line in text.splitlines())


def test_saved_across_backward_is_every_other_matmul():
    where = remat.saved_across_backward(RematConfig(preset="alternate_matmuls"), fused_attention=True)
    kept = {n for n, w in where.items() if w == "device"}
    assert kept == {"layer_input", "query_proj", "value_proj", "flash_residuals", "mlp_gate"}
    plain = remat.saved_across_backward(RematConfig(preset="alternate_matmuls"), fused_attention=False)
    assert plain["flash_residuals"] == "remat" and plain["query_proj"] == "device"


def test_flash_forward_does_not_rerun():
    assert _forward_reruns("selective") == 1  # selective keeps the output but not the logsumexp
    assert _forward_reruns("alternate_matmuls") == 0


def test_gradients_match_no_checkpoint():
    ref = _grad("none")(Q, K, V)
    for preset in ("selective", "alternate_matmuls"):
        for got, want in zip(_grad(preset)(Q, K, V), ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_recompute_is_key_output_and_up_projections():
    cfg = load_config(None, ["model.preset=llama3-8b", "train.seq_len=8192", "remat.preset=alternate_matmuls"])
    m, tokens = cfg.model, 16384
    want = 2.0 * tokens * m.d_model * (m.n_kv_heads * m.head_dim + m.n_heads * m.head_dim + m.d_ff)
    assert recompute_flops_per_layer(cfg, tokens, attention_kernel="pallas") == want
    # cuDNN's residuals carry no name: its forward reruns, one unmasked attention forward more
    attention = 4.0 * tokens * cfg.train.seq_len * m.n_heads * m.head_dim
    assert recompute_flops_per_layer(cfg, tokens, attention_kernel="cudnn") == want + attention
