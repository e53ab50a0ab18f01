"""Where each jaxmem parameter lives in a Hugging Face Llama/Qwen2/Mistral checkpoint, and how its layout differs.

HF stores linears as [out, in] and fuses heads into one dim; our einsum layouts keep
heads separate (wq [D,N,H], wo [N,H,D], ...) and stack layers on a leading dim.
Both conventions rotate halves for RoPE, so q/k need no permutation.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxmem.schema import ModelConfig

# How the HF tensor relates to ours (per layer):
#   same       identical layout
#   transpose  HF [b, a] = ours [a, b]
#   in_heads   HF [N*H, D] = ours [D, N, H]   (q/k/v projections)
#   out_heads  HF [D, N*H] = ours [N, H, D]   (output projection)
#   bias_heads HF [N*H]    = ours [N, H]


@dataclasses.dataclass(frozen=True)
class ParamMap:
    path: tuple[str, ...]  # key path in the params pure dict
    hf_name: str  # "{layer}" is the layer number for stacked params
    kind: str

    @property
    def stacked(self) -> bool:
        return self.path[0] == "layers"

    def hf_names(self, n_layers: int) -> list[str]:
        return [self.hf_name.format(layer=i) for i in range(n_layers)] if self.stacked else [self.hf_name]


def param_maps(cfg: ModelConfig) -> list[ParamMap]:
    """Every parameter of the Transformer for `cfg`, in HF checkpoint order."""
    layer = "model.layers.{layer}."
    maps = [ParamMap(("embed",), "model.embed_tokens.weight", "same"),
            ParamMap(("layers", "attn_norm"), layer + "input_layernorm.weight", "same")]
    for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v")):
        maps.append(ParamMap(("layers", ours), layer + f"self_attn.{theirs}_proj.weight", "in_heads"))
    if cfg.qkv_bias:
        for ours, theirs in (("bq", "q"), ("bk", "k"), ("bv", "v")):
            maps.append(ParamMap(("layers", ours), layer + f"self_attn.{theirs}_proj.bias", "bias_heads"))
    maps += [ParamMap(("layers", "wo"), layer + "self_attn.o_proj.weight", "out_heads"),
             ParamMap(("layers", "mlp_norm"), layer + "post_attention_layernorm.weight", "same"),
             ParamMap(("layers", "w_gate"), layer + "mlp.gate_proj.weight", "transpose"),
             ParamMap(("layers", "w_up"), layer + "mlp.up_proj.weight", "transpose"),
             ParamMap(("layers", "w_down"), layer + "mlp.down_proj.weight", "transpose"),
             ParamMap(("final_norm",), "model.norm.weight", "same")]
    if not cfg.tie_embeddings:
        maps.append(ParamMap(("lm_head",), "lm_head.weight", "transpose"))
    return maps


def hf_shape(kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape for our per-layer `shape`."""
    if kind == "same":
        return tuple(shape)
    if kind == "transpose":
        return tuple(reversed(shape))
    if kind == "in_heads":
        d, n, h = shape
        return (n * h, d)
    if kind == "out_heads":
        n, h, d = shape
        return (d, n * h)
    if kind == "bias_heads":
        n, h = shape
        return (n * h,)
    raise ValueError(kind)


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


def read_slice(kind: str, read: Callable[[tuple], np.ndarray], index: tuple, shape: tuple[int, ...]) -> np.ndarray:
    """Our per-layer slice `index` of a tensor of our `shape`, reading only that part of the HF tensor.

    `read(hf_index)` returns the HF tensor's slice `hf_index`.
    """
    idx = _ranges(index, shape)
    if kind == "same":
        return read(tuple(idx))
    if kind == "transpose":
        return read((idx[1], idx[0])).T
    if kind == "in_heads":
        d, n, h = idx
        block = read((_head_rows(n, shape[2]), d))
        return block.reshape(n.stop - n.start, shape[2], -1).transpose(2, 0, 1)[:, :, h]
    if kind == "out_heads":
        n, h, d = idx
        block = read((d, _head_rows(n, shape[1])))
        return block.reshape(d.stop - d.start, n.stop - n.start, shape[1]).transpose(1, 2, 0)[:, h, :]
    if kind == "bias_heads":
        n, h = idx
        return read((_head_rows(n, shape[1]),)).reshape(n.stop - n.start, shape[1])[:, h]
    raise ValueError(kind)


def to_hf(kind: str, array: np.ndarray) -> np.ndarray:
    """Our full per-layer tensor in HF layout."""
    if kind == "same":
        return array
    if kind == "transpose":
        return array.T
    if kind == "in_heads":
        d, n, h = array.shape
        return array.reshape(d, n * h).T
    if kind == "out_heads":
        n, h, d = array.shape
        return array.reshape(n * h, d).T
    if kind == "bias_heads":
        return array.reshape(-1)
    raise ValueError(kind)
