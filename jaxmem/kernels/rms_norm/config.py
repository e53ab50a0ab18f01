"""Block sizes of the fused RMSNorm kernels (frozen, hashable: they are static arguments)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RmsNormBlocks:
    max_tile_elements: int = 16384  # rows per program = this / padded D (at least 1), a power of two
    num_warps: int = 4

    def rows(self, padded_d: int) -> int:
        r = 1
        while r * 2 * padded_d <= self.max_tile_elements:
            r *= 2
        return r
