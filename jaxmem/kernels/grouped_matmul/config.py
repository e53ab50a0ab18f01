"""Block sizes of the grouped matmul implementations (frozen, hashable: they are static arguments)."""
from __future__ import annotations

import dataclasses

CHUNK_WEIGHT_BYTES = 32 * 2**20  # by shape: a chunk gathers about this many bytes of expert weights


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlocks:
    block_rows: int = 128  # rows per block; every block belongs to one group (each group padded to a multiple)
    chunk_blocks: int = 0  # blocks per loop step (one batched dot); 0: by shape, about CHUNK_WEIGHT_BYTES of weights
    pallas_block_k: int = 64  # Pallas: contraction columns per inner step (a power of two >= 16)
    pallas_block_n: int = 128  # Pallas: output columns per program (a power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        if not isinstance(self.block_rows, int) or self.block_rows < 1:
            raise ValueError(f"grouped matmul block_rows: {self.block_rows!r} must be a positive int")
        if not isinstance(self.chunk_blocks, int) or self.chunk_blocks < 0:
            raise ValueError(f"grouped matmul chunk_blocks: {self.chunk_blocks!r} must be a positive int or 0")

    def chunk(self, n_blocks: int, weight_bytes_per_group: int) -> int:
        """Blocks per loop step for n_blocks blocks whose group weights are weight_bytes_per_group each."""
        by_shape = max(1, CHUNK_WEIGHT_BYTES // max(1, weight_bytes_per_group))
        return max(1, min(n_blocks, self.chunk_blocks or by_shape))
