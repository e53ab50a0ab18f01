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


# Smallest opt-in shared memory per block among the shipped targets (sm_89's, in bytes): blocks that fit it
# build on every target.
SHARED_MEMORY_BUDGET = 99 * 1024


def fit_shared_memory(blocks: AttentionBlocks, head_dim: int, itemsize: int,
                      budget: int = SHARED_MEMORY_BUDGET) -> AttentionBlocks:
    """Halves block_k, then block_q (not below 16) until the tiles fit `budget` bytes of shared memory.

    Estimate: one q tile plus `num_stages` pipelined k and v tiles, the kernels' largest working set, plus
    16 bytes per head-dim column of Triton's own scratch (without that term a Gemma 3 tile passed the
    estimate and failed to compile: benchmarks/constants.md, attention).
    """
    def need(b: AttentionBlocks) -> int:
        return itemsize * head_dim * (b.block_q + 2 * b.num_stages * b.block_k) + 16 * head_dim

    while need(blocks) > budget:
        if blocks.block_k > 16 and blocks.block_k >= blocks.block_q:
            blocks = dataclasses.replace(blocks, block_k=blocks.block_k // 2)
        elif blocks.block_q > 16:
            blocks = dataclasses.replace(blocks, block_q=blocks.block_q // 2)
        elif blocks.block_k > 16:
            blocks = dataclasses.replace(blocks, block_k=blocks.block_k // 2)
        else:
            break
    return blocks
