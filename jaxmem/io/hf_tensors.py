"""How a Hugging Face tensor's layout differs from the jaxmem parameter it holds (one object per layout).

HF stores linears as [out, in] and fuses heads into one dim; our einsum layouts keep
heads separate (wq [D,N,H], wo [N,H,D], ...) and stack layers on a leading dim.
Both conventions rotate halves for RoPE, so q/k need no permutation. Gemma stores its RMSNorm weights as
w with the norm multiplying by (1 + w); ours multiply by the weight itself, so that layout adds one.
Which tensor maps to which parameter is each model family's business (jaxmem.io.hf_families).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import numpy as np

# How the HF tensor relates to ours (per layer):
#   same       identical layout
#   transpose  HF [b, a] = ours [a, b]
#   in_heads   HF [N*H, D] = ours [D, N, H]   (q/k/v projections)
#   out_heads  HF [D, N*H] = ours [N, H, D]   (output projection)
#   bias_heads HF [N*H]    = ours [N, H]
#   plus_one   HF w        = ours - 1         (Gemma's (1 + w) RMSNorm weights)
#   even_cols  HF [..., 2F][..., 0::2] = ours [..., F]   (gpt-oss's fused, interleaved expert gate_up: gate)
#   odd_cols   HF [..., 2F][..., 1::2] = ours [..., F]   (... and up)
# Two parameters that share one HF tensor (even_cols + odd_cols) each write theirs with zeros in the other's
# columns; `merge_hf` adds the parts.


@dataclasses.dataclass(frozen=True)
class ParamMap:
    path: tuple[str, ...]  # key path in the params pure dict
    hf_name: str  # "{layer}" is the layer number for stacked params
    kind: str

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    @property
    def lead(self) -> int:
        """Leading dims of our array that index HF tensors: 0, 1 (layers) or 2 (layers, experts: "{expert}" in
        hf_name; one HF tensor per layer and expert)."""
        return int(self.stacked) + int("{expert}" in self.hf_name)

    def name_at(self, key: tuple = ()) -> str:
        """The HF tensor at our leading index `key` ((), (layer,) or (layer, expert))."""
        return self.hf_name.format(**dict(zip(("layer", "expert"), key)))

    def keys(self, shape: tuple[int, ...]) -> list[tuple]:
        """Every leading index of our array of `shape`, in HF checkpoint order."""
        return list(itertools.product(*(range(n) for n in shape[:self.lead])))

    def hf_names(self, n_layers: int) -> list[str]:
        return [self.hf_name.format(layer=i) for i in range(n_layers)] if self.stacked else [self.hf_name]


def _ranges(index: tuple, shape: tuple[int, ...]) -> list[slice]:
    out = []
    for s, size in zip(index, shape):
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not supported")
        out.append(slice(start, stop))
    return out


def _head_rows(n: slice, head_dim: int) -> slice:
    return slice(n.start * head_dim, n.stop * head_dim)


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """shape(ours) -> HF shape; read(read_hf, idx, shape) -> our slice `idx` (ranges) of a tensor of our `shape`,
    reading only that part of the HF tensor; to_hf(ours) -> the whole HF tensor."""
    shape: Callable
    read: Callable
    to_hf: Callable


def _read_in_heads(read, idx, shape):
    d, n, h = idx
    block = read((_head_rows(n, shape[2]), d))
    return block.reshape(n.stop - n.start, shape[2], -1).transpose(2, 0, 1)[:, :, h]


def _read_out_heads(read, idx, shape):
    n, h, d = idx
    block = read((d, _head_rows(n, shape[1])))
    return block.reshape(d.stop - d.start, n.stop - n.start, shape[1]).transpose(1, 2, 0)[:, h, :]


def _read_bias_heads(read, idx, shape):
    n, h = idx
    return read((_head_rows(n, shape[1]),)).reshape(n.stop - n.start, shape[1])[:, h]


def _interleaved(first: int) -> TensorLayout:
    """Our [..., F] as every second column of HF's [..., 2F], from column `first`."""
    def read(read_hf, idx, shape):
        *lead, f = idx
        return read_hf((*lead, slice(2 * f.start, 2 * f.stop)))[..., first::2]

    def to_hf(a):
        out = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), a.dtype)
        out[..., first::2] = a
        return out

    return TensorLayout(lambda s: s[:-1] + (2 * s[-1],), read, to_hf)


TENSOR_LAYOUTS: dict[str, TensorLayout] = {
    "same": TensorLayout(tuple, lambda read, idx, shape: read(tuple(idx)), lambda a: a),
    "transpose": TensorLayout(lambda s: tuple(reversed(s)), lambda read, idx, shape: read((idx[1], idx[0])).T,
                              lambda a: a.T),
    "in_heads": TensorLayout(lambda s: (s[1] * s[2], s[0]), _read_in_heads,
                             lambda a: a.reshape(a.shape[0], -1).T),
    "out_heads": TensorLayout(lambda s: (s[2], s[0] * s[1]), _read_out_heads,
                              lambda a: a.reshape(-1, a.shape[2]).T),
    "bias_heads": TensorLayout(lambda s: (s[0] * s[1],), _read_bias_heads, lambda a: a.reshape(-1)),
    "plus_one": TensorLayout(tuple, lambda read, idx, shape: read(tuple(idx)).astype(np.float32) + 1,
                             lambda a: (a.astype(np.float32) - 1).astype(a.dtype)),
    "even_cols": _interleaved(0),
    "odd_cols": _interleaved(1),
}


def _layout(kind: str) -> TensorLayout:
    if kind not in TENSOR_LAYOUTS:
        raise ValueError(f"tensor layout {kind!r} is unknown; one of {', '.join(TENSOR_LAYOUTS)}")
    return TENSOR_LAYOUTS[kind]


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for our per-layer `shape`."""
    return tuple(_layout(kind).shape(tuple(shape)))


def read_slice(kind: str, read: Callable[[tuple], np.ndarray], index: tuple, shape: tuple[int, ...]) -> np.ndarray:
    """Our per-layer slice `index` of a tensor of our `shape`, reading only that part of the HF tensor.

    `read(hf_index)` returns the HF tensor's slice `hf_index`.
    """
    return _layout(kind).read(read, _ranges(index, shape), shape)


def to_hf(kind: str, array: np.ndarray) -> np.ndarray:
    """Our full per-layer tensor in HF layout."""
    return _layout(kind).to_hf(array)


def merge_hf(parts: list[np.ndarray]) -> np.ndarray:
    """One HF tensor from the parameters that share it (each zero outside its own columns)."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out
