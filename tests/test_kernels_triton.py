"""jax-triton fused linear + cross-entropy: Triton-interpreter numerics on CPU, deviceless sm_90 compile.

JAX cannot run a triton_call on CPU, so the numerics test runs the same
@triton.jit kernels under Triton's own interpreter (TRITON_INTERPRET=1, torch
CPU tensors) in a subprocess, driving the slabs the way `backward_grads` does,
and compares with the fp32 reference.
"""
import os
import subprocess
import sys
import textwrap

import pytest

from jaxmem.config import KernelConfig
from jaxmem.kernels import KernelUnavailable, select_loss
from test_kernels_common import compile_loss_for_h100

INTERPRETED = textwrap.dedent("""
    import numpy as np, torch, triton
    import jax, jax.numpy as jnp
    from jaxmem.kernels.cross_entropy import triton as tk
    from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
    from jaxmem.kernels.cross_entropy.reference import linear_cross_entropy_reference

    t, d, v, z = 37, 40, 203, 1e-3
    blocks = CrossEntropyBlocks(pallas_block_t=16, pallas_block_v=32, pallas_block_d=16, slab_v=64)
    rng = np.random.default_rng(0)
    h = rng.standard_normal((t, d), dtype=np.float32)
    w = 0.5 * rng.standard_normal((d, v), dtype=np.float32)
    labels = rng.integers(0, v, t).astype(np.int32)
    labels[::5] = -100
    labels[-1] = v - 1
    bt, bv, bd, slab = tk.tiles(t, d, v, blocks)
    T = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    lse, target = torch.zeros(t), torch.zeros(t)
    tk.forward_kernel[(triton.cdiv(t, bt),)](T(h), T(w), T(labels), lse, target, T=t, D=d, V=v, BT=bt, BV=bv, BD=bd)
    lse, target = lse.numpy(), target.numpy()
    valid = labels != -100
    loss = np.sum(np.where(valid, lse - target + z * lse * lse, 0.0))

    def ref(h, w):
        return linear_cross_entropy_reference(h, w, jnp.asarray(labels), z_loss=z)[0]
    ref_loss, (ref_dh, ref_dw) = jax.value_and_grad(ref, (0, 1))(h, w)
    soft = np.where(valid, 1.0 + 2 * z * lse, 0.0).astype(np.float32)
    onehot = valid.astype(np.float32)
    dh, dw = torch.zeros(t, d), np.zeros((d, v), np.float32)
    for s in range(triton.cdiv(v, slab)):
        nominal = s * slab
        start = max(min(nominal, v - slab), 0)
        dw_slab = torch.zeros(d, slab)
        tk.backward_kernel[(triton.cdiv(t, bt), slab // bv)](
            T(h), T(w), T(labels), T(lse), T(soft), T(onehot), T(np.array([start, nominal], np.int32)), dh, dh,
            dw_slab, T=t, D=d, V=v, SLAB=slab, BT=bt, BV=bv, BD=bd)
        width = min(slab, v)
        dw[:, start:start + width] = dw_slab.numpy()[:, :width]
    for name, a, b in (("loss", loss, ref_loss), ("dh", dh.numpy(), ref_dh), ("dw", dw, ref_dw)):
        err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        scale = float(np.max(np.abs(np.asarray(b))))
        print(name, err, scale)
        assert err <= 1e-4 * scale, (name, err, scale)
    print("TRITON-INTERPRETER-OK")
""")


def test_triton_kernels_match_reference_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=600)
    assert "TRITON-INTERPRETER-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_triton_on_cpu_is_refused():
    with pytest.raises(KernelUnavailable, match="no CPU or interpret path"):
        select_loss(KernelConfig(loss="triton"), "cpu")


@pytest.mark.slow
def test_triton_compiles_for_h100_at_llama3_size():
    from jaxmem.kernels.cross_entropy import triton as triton_ce

    memory = compile_loss_for_h100(triton_ce.linear_cross_entropy)
    assert memory.temp_size_in_bytes < 0.5 * 2**30
