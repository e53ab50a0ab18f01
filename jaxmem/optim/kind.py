"""Which optimizer state a run keeps, resolved once from the config: AdamW with fp32, bf16, int8 or int4
moments, or Adafactor (factored second moment, no first moment). The program builds its optimizer from it
(jaxmem.optim.choice) and the planner counts its bytes from it."""
from __future__ import annotations

import dataclasses
import math

from jaxmem.config.schema import Config

FLOAT_MOMENTS = {"float32": 4, "bfloat16": 2}  # bytes per value
LOWBIT_MOMENTS = {"int8": 8, "int4": 4}  # bits per value
# Default block length along a tensor's last dim per bit width: bitsandbytes' 2048 for 8 bits, the 128 of
# 4-bit AdamW (arXiv 2309.01507) for 4; tensors under THRESHOLD values keep fp32 moments.
DEFAULT_BLOCK = {8: 2048, 4: 128}
THRESHOLD = 4096


def quantizes(shape: tuple[int, ...], threshold: int = THRESHOLD) -> bool:
    """Whether a tensor of `shape` keeps block-quantized moments: a matrix (or wider) of at least `threshold`
    values. Vectors (norms, biases) keep fp32 whatever their length: a few bytes, and the most sensitive to
    rounding (bitsandbytes quantizes those of 4096 values and more too)."""
    return len(shape) >= 2 and math.prod(shape) >= threshold


@dataclasses.dataclass(frozen=True)
class StateKind:
    name: str  # "adamw" or "adafactor"
    moment: str  # precision.moment_dtype: float32, bfloat16, int8, int4 (AdamW's m and v)
    block: int  # values per quantization block along the last dim (0: moments not quantized)

    @classmethod
    def from_config(cls, cfg: Config) -> "StateKind":
        p = cfg.precision
        bits = LOWBIT_MOMENTS.get(p.moment_dtype)
        block = (p.moment_block or DEFAULT_BLOCK[bits]) if bits else 0
        return cls(cfg.optimizer.name, p.moment_dtype, block)

    @property
    def bits(self) -> int | None:
        """Bits per stored moment value where the moments are block-quantized, else None."""
        return LOWBIT_MOMENTS.get(self.moment) if self.name == "adamw" else None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def label(self) -> str:
        if self.name == "adafactor":
            return "Adafactor (factored fp32 second moment, no first moment)"
        if self.quantized:
            return (f"AdamW, {self.moment} moments in blocks of {self.block} (fp32 for vectors and tensors under "
                    f"{THRESHOLD} values)")
        return f"AdamW, {self.moment} moments"

    def moment_bytes_per_value(self) -> tuple[float, float]:
        """(m, v) bytes per value of a large tensor: a float moment's itemsize; a quantized one's code bits
        plus its block's fp32 scale; Adafactor's factored rows and columns (4 bytes per row and per column,
        about 0 per value) and no m. Exact figures per tensor come from the state's own shapes
        (jaxmem.core.accounting.opt_state_bytes); this is for the per-leaf peaks of a streamed update."""
        if self.name == "adafactor":
            return 0, 0
        if self.quantized:
            per = self.bits / 8 + 4 / self.block
            return per, per
        size = FLOAT_MOMENTS[self.moment]
        return size, size

    def cuts(self, shape: tuple[int, ...], axis: int, count: int) -> bool:
        """Whether a leaf's state can be updated in `count` equal pieces along `axis` of its param: not
        Adafactor's (its factored rows and columns mix the pieces); a quantized one not along the last dim,
        where its blocks run (a piece's codes and scales along a leading dim are the whole's rows)."""
        if count == 1:
            return True
        if self.name == "adafactor":
            return False
        return not (self.quantized and quantizes(shape)) or axis != len(shape) - 1
