"""Block sizes of the fused LM head + cross-entropy kernels (frozen, hashable: they are static arguments)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlocks:
    block_t: int = 1024  # tokens per tile (chunked); Pallas uses pallas_block_t
    block_v: int = 4096  # vocab columns per tile (chunked); Pallas uses pallas_block_v
    pallas_block_t: int = 128  # tokens per tile of the Pallas / Triton kernels
    pallas_block_v: int = 128
    pallas_block_d: int = 64  # embed dims per inner matmul step of the Pallas / Triton kernels
    slab_v: int = 16384  # vocab columns per backward call: bounds the fp32 dW scratch to [D, slab_v]
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"kernels block size {f.name}: {value!r} must be a positive int")
