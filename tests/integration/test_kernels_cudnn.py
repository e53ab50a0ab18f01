"""cuDNN attention: the segment-ids conversion (values, on CPU), the version guard, and deviceless sm_90
compiles of the cuDNN custom calls (need the cuDNN library: the `aot-cudnn` extra)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.runtime import compat
from jaxmem.kernels.attention import cudnn
from jaxmem.kernels.attention.cudnn import cudnn_attention, packed_segments



def _has_cudnn_library() -> bool:
    try:
        return importlib.util.find_spec("nvidia.cudnn") is not None
    except ModuleNotFoundError:  # no nvidia.* wheel at all
        return False


needs_cudnn = pytest.mark.skipif(not _has_cudnn_library(),
                                 reason="cuDNN library not installed (pip install 'jaxmem[aot-cudnn]')")
# `make test` installs the cuDNN wheel into a side folder and names it here: the two compile tests below then
# run in a subprocess that sees it, while the rest of the suite keeps planning without cuDNN (with the
# library present, `kernels.attention=auto` compiles cuDNN deviceless, which would change every compiled
# figure the other tests check).
CUDNN_SITE = os.environ.get("JAXMEM_TEST_CUDNN_SITE", "")


@pytest.mark.skipif(_has_cudnn_library() or not (CUDNN_SITE and Path(CUDNN_SITE, "nvidia", "cudnn").is_dir()),
                    reason="the cuDNN library is importable here (the tests run directly) or no side folder")
def test_cudnn_compile_tests_in_a_process_with_the_library():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(CUDNN_SITE).resolve()),
                                                       os.environ.get("PYTHONPATH", "")]))
    env.pop("JAXMEM_TEST_CUDNN_SITE")
    names = "compiles_for_h100_deviceless or does_not_lower_deviceless"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", names],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=600)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout[-3000:] + p.stderr[-2000:]


def test_packed_segments_values():
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2],
                     [5, 5, 5, 5, 5, 5, 5, 5],
                     [0, 1, 2, 3, 4, 5, 6, 7],
                     [-1, -1, 3, 3, 3, 3, 9, 9]])
    seqlen, offsets, overflow = packed_segments(seg, 3)
    np.testing.assert_array_equal(seqlen, [[3, 2, 3], [8, -1, -1], [1, 1, 1], [2, 4, 2]])
    np.testing.assert_array_equal(offsets, [[0, 3, 5, -1], [0, -1, -1, -1], [0, 1, 2, -1], [0, 2, 6, -1]])
    np.testing.assert_array_equal(overflow, [False, False, True, False])
    with pytest.raises(ValueError, match="max_segments 1"):
        packed_segments(seg, 1)


def _mask_from_packed(seqlen, offsets, t):
    """[B, T, T] causal-within-segment mask rebuilt from (seqlen, offsets), as cuDNN reads them."""
    pos = np.arange(t)
    masks = []
    for lengths, starts in zip(np.asarray(seqlen), np.asarray(offsets)):
        run = np.full(t, -1)
        for i, (n, s) in enumerate(zip(lengths, starts)):
            if n >= 0:
                run[s:s + n] = i
        assert (run >= 0).all(), "every token must fall in a segment"
        masks.append((run[:, None] == run[None, :]) & (pos[:, None] >= pos[None, :]))
    return np.stack(masks)


def test_packed_segments_give_the_reference_mask():
    """The packed layout masks exactly what attention_reference masks for contiguous documents."""
    t = 96
    seg = jnp.cumsum(jax.random.bernoulli(jax.random.key(3), 0.08, (4, t)), axis=1).astype(jnp.int32)
    seqlen, offsets, overflow = packed_segments(seg, 16)
    assert not overflow.any()
    s = np.asarray(seg)
    expected = (s[:, :, None] == s[:, None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
    np.testing.assert_array_equal(_mask_from_packed(seqlen, offsets, t), expected)


def test_segment_ids_refused_outside_the_checked_jax(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.12.0")
    x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(compat.UnsupportedVersion, match="packed sequences in cuDNN attention.*0.12.0"):
        cudnn_attention(x, x, x, jnp.zeros((1, 16), jnp.int32))


B, T, N, K, H = 1, 1024, 4, 2, 64


def _h100_specs():
    from jaxmem.runtime.aot import target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return spec


def _fwd_bwd(attend):
    return jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


@needs_cudnn
def test_cudnn_fwd_bwd_compiles_for_h100_deviceless():
    spec = _h100_specs()
    args = (spec(B, T, N, H), spec(B, T, K, H), spec(B, T, K, H))
    compiled = _fwd_bwd(lambda q, k, v: cudnn_attention(q, k, v)).lower(*args).compile()
    hlo = compiled.as_text()
    assert "__cudnn$fmhaSoftmax\"" in hlo and "__cudnn$fmhaSoftmaxBackward" in hlo
    # XLA sizes the cuDNN workspace only with a device (CuDnnWorkspaceRewriter needs a StreamExecutor):
    # deviceless it stays u8[0], so the temp below leaves out the backward workspace (2 MiB at this shape,
    # 257 MiB at seq 8192 with 32 heads, compiled on an H100)
    assert "u8[0]" in hlo
    cudnn_temp = compiled.memory_analysis().temp_size_in_bytes
    xla_temp = _fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
                        ).lower(*args).compile().memory_analysis().temp_size_in_bytes
    scores = B * N * T * T * 4  # one [B, N, T, S] fp32 score matrix: 16 MiB here
    assert xla_temp >= 2 * scores  # 44 MiB compiled (jax 0.10.2): scores and their gradient
    assert cudnn_temp < scores / 8  # 1.02 MiB compiled: softmax statistics and layout copies, no scores
    assert cudnn_temp < xla_temp / 20


@needs_cudnn
def test_packed_cudnn_does_not_lower_deviceless():
    """jax checks Hopper for the packed layout against the default backend (CPU here), so packed cuDNN
    attention lowers only in a process that runs on the GPU. When jax changes that, this test fails: then
    add the packed case to the deviceless compile above."""
    spec = _h100_specs()
    args = (spec(B, T, N, H), spec(B, T, K, H), spec(B, T, K, H), spec(B, T, dtype=jnp.int32))
    fn = jax.jit(lambda q, k, v, seg: cudnn_attention(q, k, v, seg))
    if not compat.in_range(jax.__version__, cudnn.PACKED_RANGE):  # outside it, refused before jax is asked
        with pytest.raises(compat.UnsupportedVersion, match="use kernels.attention='pallas' for segment ids"):
            fn.lower(*args)
        return
    with pytest.raises(NotImplementedError, match="Packed layout requires a GPU with at least Hopper"):
        fn.lower(*args)


def test_gqa_offsets_fix_version_is_inside_the_range():
    assert compat.in_range(cudnn.GQA_OFFSETS_FIXED, cudnn.PACKED_RANGE)
