"""Fused RMSNorm (Pallas, interpret mode on CPU) vs the fp32 reference: forward and VJP."""
import jax
import jax.numpy as jnp
import pytest

from jaxmem.config import KernelConfig
from jaxmem.kernels import select_norm
from jaxmem.kernels.rms_norm.config import RmsNormBlocks
from jaxmem.kernels.rms_norm.pallas import rms_norm
from jaxmem.kernels.rms_norm.lean import rms_norm_lean
from jaxmem.kernels.rms_norm.reference import rms_norm_reference
from kernel_checks import TOLERANCES, assert_close


class RmsNormCases:
    def norm(self, x, w, eps):
        raise NotImplementedError

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("shape", [(3, 7, 48), (37, 128)])  # rows not a multiple of the block, D not pow2
    def test_forward_and_vjp(self, shape, dtype):
        k = jax.random.split(jax.random.key(shape[-1]), 3)
        x = (3.0 * jax.random.normal(k[0], shape, jnp.float32)).astype(dtype)
        w = (1.0 + 0.2 * jax.random.normal(k[1], shape[-1:], jnp.float32)).astype(dtype)
        ct = jax.random.normal(k[2], shape, jnp.float32)
        f = lambda x, w: jnp.sum(self.norm(x, w, 1e-5).astype(jnp.float32) * ct)
        ref = lambda x, w: jnp.sum(rms_norm_reference(x.astype(jnp.float32), w.astype(jnp.float32), 1e-5) * ct)
        y = jax.jit(lambda x, w: self.norm(x, w, 1e-5))(x, w)
        assert y.dtype == dtype
        rtol, gtol = TOLERANCES[dtype]
        assert_close(y, rms_norm_reference(x.astype(jnp.float32), w.astype(jnp.float32), 1e-5), rtol * 10, "y")
        grads = jax.jit(jax.grad(f, (0, 1)))(x, w)
        ref_grads = jax.grad(ref, (0, 1))(x, w)
        assert_close(grads[0], ref_grads[0], gtol, "dx")
        assert_close(grads[1], ref_grads[1], gtol, "dw (summed over all rows)")


class TestPallasInterpret(RmsNormCases):
    def norm(self, x, w, eps):
        return rms_norm(x, w, eps, blocks=RmsNormBlocks(max_tile_elements=512), interpret=True)


class TestLeanXla(RmsNormCases):
    def norm(self, x, w, eps):
        return rms_norm_lean(x, w, eps)


def test_dispatch():
    chosen = lambda cfg, platform: select_norm(cfg, platform).__wrapped__  # under its named scope  # noqa: E731
    assert chosen(KernelConfig(norm="xla"), "cpu") is rms_norm_lean
    assert chosen(KernelConfig(norm="auto"), "cpu") is rms_norm_lean
    assert chosen(KernelConfig(norm="auto"), "gpu") is rms_norm_lean  # XLA fuses it as well
    x, w = jnp.ones((2, 32)), jnp.full((32,), 2.0)
    assert_close(select_norm(KernelConfig(norm="pallas"), "cpu")(x, w, 1e-6), 2 * x, 1e-6, "pallas on cpu")


@pytest.mark.slow
def test_pallas_compiles_for_h100():
    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    x = jax.ShapeDtypeStruct((2, 8192, 4096), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16, sharding=sharding)

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(rms_norm, x, w)
        return vjp(y)

    memory = compile_abstract(fwd_bwd, x, w).memory_analysis()
    assert memory.temp_size_in_bytes < 2 * 2 * 8192 * 4096 * 2  # no fp32 copy of x
