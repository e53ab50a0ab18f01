"""Fused LM head + cross-entropy: chunked and Pallas (interpret) vs the fp32 reference, forward and VJP."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jaxmem.config import ConfigError, KernelConfig
from jaxmem.kernels import KernelUnavailable, select_attention, select_loss, select_token_logprobs
from jaxmem.kernels.cross_entropy import chunked, pallas
from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import (IGNORE_INDEX, linear_cross_entropy_reference,
                                                    linear_token_logprobs_reference)
from kernel_checks import LLAMA3_LOSS_SHAPE, compile_loss_for_h100, TOLERANCES, assert_close

SMALL = CrossEntropyBlocks(block_t=16, block_v=64, pallas_block_t=16, pallas_block_v=64, pallas_block_d=16)
WIDE = CrossEntropyBlocks(block_t=16, block_v=8192, pallas_block_t=16, pallas_block_v=1024, pallas_block_d=32)


def _inputs(t, d, v, dtype, seed=0, masked_every=5):
    k = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
    w = (0.5 * jax.random.normal(k[1], (d, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k[2], (t,), 0, v)
    labels = labels.at[::masked_every].set(IGNORE_INDEX).at[-1].set(v - 1)  # masked tokens + the last column
    return h, w, labels


def _reference(h, w, labels, z_loss):
    f = lambda h, w: linear_cross_entropy_reference(h.astype(jnp.float32), w.astype(jnp.float32), labels,
                                                    z_loss=z_loss)[0]
    return f(h, w), jax.grad(f, (0, 1))(h, w)


class CrossEntropyCases:
    """Forward and VJP of `loss(h, w, labels, z_loss)` against the fp32 reference."""

    blocks = SMALL

    def loss(self, h, w, labels, z_loss, blocks):
        raise NotImplementedError

    def check(self, t, d, v, dtype, z_loss=0.0, blocks=None):
        blocks = blocks or self.blocks
        h, w, labels = _inputs(t, d, v, dtype)
        f = lambda h, w: self.loss(h, w, labels, z_loss, blocks)
        (loss, n_valid), grads = jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, w)
        ref_loss, ref_grads = _reference(h, w, labels, z_loss)
        rtol, gtol = TOLERANCES[dtype]
        assert_close(loss, ref_loss, rtol, "loss")
        assert_close(grads[0], ref_grads[0], gtol, "dh")
        assert_close(grads[1], ref_grads[1], gtol, "dW")
        assert grads[0].dtype == h.dtype and grads[1].dtype == w.dtype
        assert int(n_valid) == int(np.sum(np.asarray(labels) != IGNORE_INDEX))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    def test_odd_shape(self, dtype):
        self.check(37, 48, 503, dtype)  # T, V not multiples of any block

    def test_z_loss(self):
        self.check(21, 32, 300, jnp.float32, z_loss=1e-3)

    def test_gpt2_vocab(self):
        self.check(19, 32, 50257, jnp.float32, blocks=WIDE)


class TestChunked(CrossEntropyCases):
    def loss(self, h, w, labels, z_loss, blocks):
        return chunked.linear_cross_entropy(h, w, labels, blocks=blocks, z_loss=z_loss)

    def test_qwen_vocab(self):
        self.check(9, 16, 151665, jnp.float32, blocks=WIDE)


class TestPallasInterpret(CrossEntropyCases):
    def loss(self, h, w, labels, z_loss, blocks):
        return pallas.linear_cross_entropy(h, w, labels, blocks=blocks, z_loss=z_loss, interpret=True)


def test_all_tokens_masked_gives_zero_loss_and_grads():
    h, w, _ = _inputs(8, 16, 70, jnp.float32)
    labels = jnp.full((8,), IGNORE_INDEX)
    for impl in (chunked.linear_cross_entropy, functools.partial(pallas.linear_cross_entropy, interpret=True)):
        loss, grads = jax.value_and_grad(lambda h, w: impl(h, w, labels, blocks=SMALL)[0], (0, 1))(h, w)
        assert float(loss) == 0.0 and not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1]))


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@pytest.mark.parametrize(("shape", "dw_axes"), [((1, 8, 1), ()), ((1, 4, 2), ("fsdp",)), ((2, 2, 2), ("dp", "fsdp")),
                                                ((2, 2, 2), ("fsdp",))])
def test_sharded_loss_matches_reference(impl, shape, dw_axes):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    cfg = KernelConfig(loss=impl, loss_block_t=16, loss_block_v=64, z_loss=1e-4)
    fn = select_loss(cfg, "cpu", mesh=mesh, dw_axes=dw_axes)
    h, w, labels = _inputs(64, 32, 200, jnp.float32, seed=3)
    loss, grads = jax.jit(jax.value_and_grad(lambda h, w: fn(h, w, labels)[0], (0, 1)))(h, w)
    ref_loss, ref_grads = _reference(h, w, labels, 1e-4)
    assert_close(loss, ref_loss, 2e-5, "loss")
    assert_close(grads[0], ref_grads[0], 2e-5, "dh")
    assert_close(grads[1], ref_grads[1], 2e-5, "dW")


def _logprobs_reference(h, w, labels, g):
    f = lambda h, w: jnp.sum(g * linear_token_logprobs_reference(h.astype(jnp.float32), w.astype(jnp.float32),
                                                                 labels))
    return linear_token_logprobs_reference(h, w, labels), jax.grad(f, (0, 1))(h, w)


def _check_logprobs(fn, t, d, v, tol, blocks=SMALL):
    """Per-token log-probs and the VJP of a per-token cotangent, against the [T, V] reference."""
    h, w, labels = _inputs(t, d, v, jnp.float32, seed=7)
    g = jax.random.normal(jax.random.key(11), (t,), jnp.float32)
    logp, vjp = jax.vjp(lambda h, w: fn(h, w, labels), h, w)
    ref, ref_grads = _logprobs_reference(h, w, labels, g)
    assert_close(logp, ref, tol, "logp")
    assert np.all(np.asarray(logp)[np.asarray(labels) == IGNORE_INDEX] == 0.0)
    assert np.all(np.asarray(logp)[np.asarray(labels) != IGNORE_INDEX] < 0.0)
    dh, dw = vjp(g)
    assert_close(dh, ref_grads[0], tol, "dh")
    assert_close(dw, ref_grads[1], tol, "dW")


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
def test_token_logprobs_match_reference(impl):
    """The per-token variant of the fused loss: value and VJP of a per-token cotangent, odd T and V."""
    fn = {"chunked": functools.partial(chunked.linear_token_logprobs, blocks=SMALL),
          "pallas": functools.partial(pallas.linear_token_logprobs, blocks=SMALL, interpret=True)}[impl]
    _check_logprobs(fn, 37, 48, 503, 2e-5)


@pytest.mark.parametrize("impl", ["chunked", "pallas"])
@pytest.mark.parametrize(("shape", "dw_axes"), [((1, 4, 2), ("fsdp",)), ((2, 2, 2), ("dp", "fsdp"))])
def test_sharded_token_logprobs_match_reference(impl, shape, dw_axes):
    """Per shard (tokens over the data axes, vocab over tp): the per-token cotangent stays on its tokens."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    fn = select_token_logprobs(KernelConfig(loss=impl, loss_block_t=16, loss_block_v=64), "cpu", mesh=mesh,
                               dw_axes=dw_axes)
    _check_logprobs(jax.jit(fn), 64, 32, 200, 2e-5)


@pytest.mark.parametrize(("d_model", "scattered"), [(32, True), (36, False)])
def test_sharded_loss_reduce_scatters_dw_where_the_token_axes_divide_d(d_model, scattered):
    """Asked to (the head's gradient kept split along D), dW leaves the kernel reduce-scattered over the token
    axes; where they do not divide D it is summed whole, and both equal the reference."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 8, 1), ("dp", "fsdp", "tp"), axis_types=(AxisType.Auto,) * 3)
    fn = select_loss(KernelConfig(loss="chunked", loss_block_t=16, loss_block_v=64), "cpu", mesh=mesh,
                     dw_axes=("fsdp",))
    h, w, labels = _inputs(64, d_model, 200, jnp.float32, seed=5)
    grad = jax.jit(jax.grad(lambda w: fn(h, w, labels)[0]))
    text = grad.lower(w).as_text()
    assert ("reduce_scatter" in text) is scattered
    assert_close(grad(w), _reference(h, w, labels, 0.0)[1][1], 2e-5, "dW")


@pytest.mark.parametrize(("overrides", "axes"), [
    (["parallel.fsdp=8"], ("fsdp",)),
    (["parallel.fsdp=8", "parallel.zero_stage=1"], ()),
    (["parallel.fsdp=4", "parallel.dp=2"], ("fsdp",)),
    (["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"], ("fsdp",)),
    (["parallel.fsdp=8", "model.tie_embeddings=true"], ()),
    (["parallel.fsdp=8", "lora.rank=4"], None),
])
def test_the_step_asks_the_loss_to_scatter_dw_where_the_head_gradient_is_split(overrides, axes):
    """The program passes the axes its LM head gradient is split over along d_model: FSDP's state axes at ZeRO
    2/3; none where the gradient is replicated (ZeRO-1) or split along the vocabulary (tied: the embedding);
    None where the head is frozen (LoRA), so the loss leaves dW for XLA to drop."""
    from jaxmem.features import load_config
    from jaxmem.core.program import _head_grad_axes
    from jaxmem.features import build_program

    prog = build_program(load_config("configs/tiny.yaml", overrides), devices=jax.devices())
    assert _head_grad_axes(prog) == axes


def test_dispatch_choices_and_errors():
    # under its named scope, around the [B, T] flattening
    chosen = lambda cfg, platform: select_loss(cfg, platform).__wrapped__.__wrapped__  # noqa: E731
    assert chosen(KernelConfig(loss="auto"), "cpu").func is chunked.linear_cross_entropy
    assert chosen(KernelConfig(loss="auto"), "gpu").func is chunked.linear_cross_entropy
    assert chosen(KernelConfig(loss="pallas"), "gpu").keywords["interpret"] is False
    assert chosen(KernelConfig(loss="pallas"), "cpu").keywords["interpret"] is True
    with pytest.raises(KernelUnavailable, match="kernels.loss='triton' is not a known"):
        select_loss(KernelConfig(loss="triton"), "cpu")  # dropped: docs/kernels.md says why
    with pytest.raises(ValueError, match="block_t"):
        CrossEntropyBlocks(block_t=-1)
    with pytest.raises(ConfigError, match="kernels.fused_loss_block_v: 100 must be a power of two"):
        select_loss(KernelConfig(loss="pallas", fused_loss_block_v=100), "cpu")
    with pytest.raises(ConfigError, match="kernels.loss_block_t: -1 must be a positive int, or 0"):
        select_loss(KernelConfig(loss="chunked", loss_block_t=-1), "cpu")
    with pytest.raises(ConfigError, match="kernels.attn_block_q"):
        select_attention(KernelConfig(attention="pallas", attn_block_q=24), "cpu")


@pytest.mark.slow
def test_pallas_compiles_for_h100_at_llama3_size():
    """Deviceless sm_90 compile at T=8192, D=4096, V=128256 (bf16): builds, and the scratch stays small."""
    t, d, v = LLAMA3_LOSS_SHAPE
    memory = compile_loss_for_h100(pallas.linear_cross_entropy)
    # the naive [T, V] fp32 logits alone are 4.2 GB; the fused scratch is dh fp32 + one tile of the backward
    assert memory.temp_size_in_bytes < 0.5 * 2**30
    assert memory.output_size_in_bytes >= 2 * (t * d + d * v)

