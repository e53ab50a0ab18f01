"""Comparisons of optimizer states shared by the optimizer tests: quantized moments (jaxmem.optim.codes) as
one code index per value, and two states that agree up to a code crossed by an fp32 ulp."""
import jax
import numpy as np

from jaxmem.optim import codes


def code_indices(q) -> np.ndarray:
    """A QTensor's code indices, one per value along the last dim (int4: both nibbles of each byte; a float8
    code: its bits, so neighbouring values of one sign are one apart)."""
    stored = np.asarray(q.codes)
    idx = (stored.view(np.uint8) if codes.CODES[q.code].storage else stored).astype(np.int32)
    if codes.CODES[q.code].bits == 4:
        idx = np.stack([idx & 15, idx >> 4], -1).reshape(idx.shape[:-1] + (-1,))[..., :q.last]
    return idx


def assert_same_moments(got, want) -> None:
    """Same scales, and the same codes but where XLA's fusions put a value one fp32 ulp across the midpoint
    of two codes (then the neighbouring code, in a handful of elements); unquantized leaves equal."""
    def same(a, b):
        if not codes.is_quantized(a):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-12)
            return
        np.testing.assert_allclose(a.scales, b.scales, rtol=1e-6)
        diff = np.abs(code_indices(a) - code_indices(b))
        assert diff.max() <= 1 and diff.mean() <= 1e-4

    jax.tree.map(same, got, want, is_leaf=codes.is_quantized)
