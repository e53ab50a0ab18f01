"""MXFP4 checkpoints (gpt-oss as published: `quantization_config.quant_method: mxfp4`), read as if dequantized.

The Hub's gpt-oss checkpoints store each layer's expert projections as `<name>_blocks` [E, out, in / 32, 16]
uint8 (two 4-bit e2m1 values a byte, the low nibble first) and `<name>_scales` [E, out, in / 32] uint8 (a
power-of-two exponent per 32 values, biased by 127). `Mxfp4Reader` wraps a CheckpointReader and shows each
such pair as the tensor `<name>` that transformers dequantizes it to, [E, in, out], so the family's name map
(jaxmem.io.hf_families_moe.GptOssFamily) reads it like a bf16 checkpoint, a slice at a time: a slice reads only
the blocks and scales it covers. Every other tensor passes through.
"""
from __future__ import annotations

import numpy as np

from jaxmem.io.hf_safetensors import CheckpointReader

# e2m1 values by 4-bit code (the sign is the top bit), as the OCP microscaling spec defines them
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
GROUP = 32  # values per scale
SCALE_BIAS = 127


def is_mxfp4(hf_config: dict) -> bool:
    quant = hf_config.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


def checkpoint_reader(path, hf_config: dict):
    """The directory's tensors, an MXFP4 checkpoint's packed experts shown dequantized."""
    reader = CheckpointReader(path)
    return Mxfp4Reader(reader) if is_mxfp4(hf_config) else reader


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """fp32 [..., G * 32] from blocks [..., G, 16] uint8 and scales [..., G] uint8."""
    low, high = FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]
    values = np.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    exponents = scales.astype(np.int32) - SCALE_BIAS
    return np.ldexp(values, exponents[..., None]).reshape(*blocks.shape[:-2], -1)


class Mxfp4Reader:
    """A CheckpointReader whose MXFP4 pairs read as their dequantized [E, in, out] tensors (fp32 values)."""

    def __init__(self, reader):
        self.reader = reader

    def _packed(self, name: str) -> bool:
        return name not in self.reader and f"{name}_blocks" in self.reader and f"{name}_scales" in self.reader

    def __contains__(self, name: str) -> bool:
        return name in self.reader or self._packed(name)

    def names(self) -> list[str]:
        """Every tensor as the model reads it: a packed pair under its dequantized name."""
        names = set(self.reader.names())
        packed = {n[:-len("_blocks")] for n in names if n.endswith("_blocks") and self._packed(n[:-len("_blocks")])}
        return sorted((names - {f"{n}{end}" for n in packed for end in ("_blocks", "_scales")}) | packed)

    def file_of(self, name: str):
        return self.reader.file_of(f"{name}_blocks" if self._packed(name) else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if not self._packed(name):
            return self.reader.shape(name)
        experts, out, groups, half = self.reader.shape(f"{name}_blocks")
        return experts, groups * 2 * half, out

    def dtype(self, name: str) -> str:
        return "F32" if self._packed(name) else self.reader.dtype(name)

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if not self._packed(name):
            return self.reader.read(name, index)
        experts, inputs, outputs = (s.indices(n) for s, n in zip(index, self.shape(name)))
        if experts[2] != 1 or inputs[2] != 1 or outputs[2] != 1:
            raise ValueError(f"{name}: strided reads of an MXFP4 tensor are not supported")
        first, last = inputs[0] // GROUP, -(-inputs[1] // GROUP)
        rows = (slice(experts[0], experts[1]), slice(outputs[0], outputs[1]), slice(first, last))
        values = dequantize(self.reader.read(f"{name}_blocks", rows + (slice(None),)),
                            self.reader.read(f"{name}_scales", rows))  # [E', out', groups' * 32]
        offset = inputs[0] - first * GROUP
        return values[:, :, offset:offset + inputs[1] - inputs[0]].transpose(0, 2, 1)
