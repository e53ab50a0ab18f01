"""Flash attention (Pallas, interpret mode on CPU) vs the fp32 reference: forward and VJP."""
import jax
import jax.numpy as jnp
import pytest

from jaxmem.config import KernelConfig
from jaxmem.kernels import KernelUnavailable, select_attention
from jaxmem.kernels.attention.config import SHARED_MEMORY_BUDGET, AttentionBlocks, fit_shared_memory
from jaxmem.kernels.attention.pallas import flash_attention
from jaxmem.kernels.attention.reference import attention_reference
from kernel_checks import TOLERANCES, assert_close, attention_inputs

SMALL = AttentionBlocks(block_q=16, block_k=16)


def _inputs(b, t, n, kv, h, dtype, segments):
    return attention_inputs(b, t, n, kv, h, dtype, segments, seed=t * n + kv)


class AttentionCases:
    """Forward and VJP of `attend(q, k, v, seg)` against `attention_reference` in fp32."""

    def attend(self, q, k, v, seg):
        raise NotImplementedError

    def check(self, b, t, n, kv, h, dtype, segments=False):
        q, k, v, ct, seg = _inputs(b, t, n, kv, h, dtype, segments)

        def fwd_bwd(attend, q, k, v):
            out, vjp = jax.vjp(attend, q, k, v)
            return out, vjp(ct.astype(out.dtype))

        f32 = lambda x: x.astype(jnp.float32)
        out, grads = jax.jit(lambda q, k, v: fwd_bwd(lambda *a: self.attend(*a, seg), q, k, v))(q, k, v)
        ref = lambda q, k, v: attention_reference(q, k, v, segment_ids_bt=seg)
        ref_out, ref_grads = fwd_bwd(ref, f32(q), f32(k), f32(v))
        rtol, gtol = TOLERANCES[dtype]
        assert out.dtype == dtype
        assert_close(out, ref_out, rtol * 5, "output")
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert g.dtype == dtype
            assert_close(g, r, gtol, name)

    def test_mha_head_dim_64_odd_length(self):
        self.check(1, 37, 2, 2, 64, jnp.float32)

    def test_mqa_head_dim_128(self):
        self.check(1, 24, 2, 1, 128, jnp.float32)

    def test_gqa_segments_bf16(self):
        self.check(1, 40, 4, 2, 32, jnp.bfloat16, segments=True)

    def test_eight_kv_heads(self):
        self.check(1, 16, 8, 8, 16, jnp.float32, segments=True)


class TestPallasInterpret(AttentionCases):
    def attend(self, q, k, v, seg):
        return flash_attention(q, k, v, seg, blocks=SMALL, interpret=True)


@pytest.mark.parametrize("block_q, block_k", [(32, 16), (16, 32)])
def test_unequal_query_and_key_blocks(block_q, block_k):
    """block_q != block_k moves where the causal loop stops and which blocks the mask cuts."""
    class Case(AttentionCases):
        def attend(self, q, k, v, seg):
            return flash_attention(q, k, v, seg, blocks=AttentionBlocks(block_q=block_q, block_k=block_k),
                                   interpret=True)

    Case().check(1, 96, 2, 1, 32, jnp.float32)


@pytest.mark.parametrize("head_dim", [24, 80, 96])
def test_head_dims_that_are_no_power_of_two(head_dim):
    """Qwen3's tiny 24, Phi's 80, 96: zero-padded up to the next Triton tile (32, 128, 128) inside the kernel;
    forward and VJP equal the reference's at the model's own head dim and scale."""
    TestPallasInterpret().check(1, 24, 2, 1, head_dim, jnp.float32)


def test_padded_head_dim_keeps_the_models_scale():
    """The default scale is head_dim ** -0.5 of the model's head dim, not of the padded tile."""
    q, k, v, _, _ = _inputs(1, 16, 2, 2, 80, jnp.float32, False)
    out = flash_attention(q, k, v, blocks=SMALL, interpret=True)
    assert out.shape == q.shape
    assert_close(out, attention_reference(q, k, v, scale=80**-0.5), TOLERANCES[jnp.float32][0] * 5, "output")


def test_bad_inputs_and_dispatch():
    q = jnp.zeros((1, 16, 3, 16))
    kv = jnp.zeros((1, 16, 2, 16))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, kv, kv, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        AttentionBlocks(block_q=24)
    with pytest.raises(KernelUnavailable, match="cudnn.*NVIDIA GPU"):
        select_attention(KernelConfig(attention="cudnn"), "cpu")
    assert select_attention(KernelConfig(attention="auto"), "cpu") is not None


def test_auto_on_gpu_sends_packed_documents_to_pallas(monkeypatch):
    """auto picks cuDNN on GPUs with the cuDNN library, Pallas without it, and a call with segment ids
    always goes to the Pallas kernel (traced here, not run: this machine has no GPU)."""
    from jaxmem import kernels

    calls = []
    monkeypatch.setattr(kernels, "cudnn_attention", lambda q, k, v, seg: calls.append(seg is None) or q)
    monkeypatch.setattr(kernels, "cudnn_present", lambda: True)
    assert kernels.resolve(KernelConfig(), "gpu", 1)["attention"] == "cudnn"
    fn = select_attention(KernelConfig(), "gpu")
    q, kv = jnp.zeros((1, 32, 2, 16), jnp.bfloat16), jnp.zeros((1, 32, 1, 16), jnp.bfloat16)  # what cuDNN takes
    assert fn(q, kv, kv, None) is q and calls == [True]
    seg = jnp.zeros((1, 32), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, seg))(q, kv, kv))
    assert "pallas_call" in jaxpr and "flash_attention_fwd" in jaxpr and calls == [True]
    # fp32 q, which cuDNN refuses, goes to the Pallas kernel too
    q32, kv32 = q.astype(jnp.float32), kv.astype(jnp.float32)
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: fn(q, k, v, None))(q32, kv32, kv32))
    assert "pallas_call" in jaxpr and calls == [True]
    monkeypatch.setattr(kernels, "cudnn_present", lambda: False)
    assert kernels.resolve(KernelConfig(), "gpu", 1)["attention"] == "pallas"


@pytest.mark.slow
def test_pallas_compiles_for_h100_llama3_8b_seq_8192():
    """Deviceless sm_90 compile of llama3-8b attention (32 q heads, 8 kv heads, head_dim 128) fwd+bwd."""
    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    spec = lambda n: jax.ShapeDtypeStruct((1, 8192, n, 128), jnp.bfloat16, sharding=sharding)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v), q, k, v)
        return vjp(out)

    memory = compile_abstract(fwd_bwd, spec(32), spec(8), spec(8)).memory_analysis()
    # the XLA path holds 32 x 8192 x 8192 fp32 scores (8 GiB) and their gradient; the kernel holds none
    assert memory.temp_size_in_bytes < 0.25 * 2**30


def test_blocks_shrink_to_fit_the_smallest_shared_memory():
    bf16 = fit_shared_memory(AttentionBlocks(), 128, 2)
    assert bf16 == AttentionBlocks()  # the defaults already fit in bf16
    fp32 = fit_shared_memory(AttentionBlocks(), 128, 4)
    assert (fp32.block_q, fp32.block_k) == (64, 32)
    assert 4 * 128 * (fp32.block_q + 2 * fp32.num_stages * fp32.block_k) + 16 * 128 <= SHARED_MEMORY_BUDGET
    wide = fit_shared_memory(AttentionBlocks(), 256, 2)  # Gemma 3's head_dim: 64 x 32 asked for 102400 bytes
    assert (wide.block_q, wide.block_k) == (32, 32)


@pytest.mark.parametrize("dtype,head_dim", [(jnp.float32, 128), (jnp.bfloat16, 256)], ids=["fp32-128", "bf16-256"])
def test_wide_tiles_compile_for_rtx4090(dtype, head_dim):
    """Deviceless sm_89 compile (99 KiB shared memory): the default 64 x 64 tiles would not fit in fp32 at
    head_dim 128, nor 64 x 32 in bf16 at Gemma 3's head_dim 256 (Triton asked for 102400 bytes)."""
    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("rtx4090-24g", 1)[0])
    q = jax.ShapeDtypeStruct((1, 256, 4, head_dim), dtype, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, 256, 2, head_dim), dtype, sharding=sharding)
    loss = lambda q, k, v: flash_attention(q, k, v).astype(jnp.float32).sum()
    compile_abstract(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)  # lowered for the sm_89 device itself
