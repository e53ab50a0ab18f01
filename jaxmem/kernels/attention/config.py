"""Block sizes of the flash-attention kernels (frozen, hashable: they are static arguments)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    block_q: int = 64  # query rows per forward / dq program
    block_k: int = 64  # key rows per inner step (forward, dq) and per dk/dv program
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"attention block size {f.name}: {value!r} must be a positive int")
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value & (value - 1) or value < 16:
                raise ValueError(f"attention block size {name}: {value} must be a power of two >= 16")
