"""Block sizes of the fused LM head + cross-entropy kernels (frozen, hashable: they are static arguments)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlocks:
    block_t: int = 0  # tokens per tile (chunked; 0: by shape, chunked.tiles); Pallas uses pallas_block_t
    block_v: int = 0  # vocab columns per tile (chunked; 0: by shape); Pallas uses pallas_block_v
    pallas_block_t: int = 256  # tokens per tile of the Pallas kernels (the tile sweep: benchmarks/kernels.md)
    pallas_block_v: int = 128
    pallas_block_d: int = 64  # embed dims per inner matmul step of the Pallas kernels
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < (0 if f.name in ("block_t", "block_v") else 1):  # 0: by shape
                raise ValueError(f"kernels block size {f.name}: {value!r} must be a positive int")
