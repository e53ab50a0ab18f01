"""Which optimizer state a run keeps, resolved once from the config (`state_kind`): AdamW with its moments in
one of the registered kinds (jaxmem.optim.states: fp32, bf16, or block-quantized), or Adafactor (factored
second moment, no first moment). The program builds its optimizer from it (jaxmem.optim.choice); the planner,
the checkpoints and tune ask it what they need and never name a kind."""
from __future__ import annotations

import dataclasses
import math

from jaxmem.config.schema import Config
from jaxmem.optim.states import KINDS, THRESHOLD, MomentKind, moment_kind


def quantizes(shape: tuple[int, ...], threshold: int = THRESHOLD) -> bool:
    """Whether a tensor of `shape` keeps block-quantized moments: a matrix (or wider) of at least `threshold`
    values. Vectors (norms, biases) keep fp32 whatever their length: a few bytes, and the most sensitive to
    rounding (bitsandbytes quantizes those of 4096 values and more too)."""
    return len(shape) >= 2 and math.prod(shape) >= threshold


@dataclasses.dataclass(frozen=True)
class StateKind:
    name: str  # "adamw" or "adafactor"
    moment: str  # precision.moment_dtype: a kind of jaxmem.optim.states (AdamW's m and v)
    block: int  # values per quantization block along the last dim (0: moments not quantized)

    @classmethod
    def from_config(cls, cfg: Config) -> "StateKind":
        p = cfg.precision
        return cls(cfg.optimizer.name, p.moment_dtype, moment_kind(p.moment_dtype).block(p.moment_block))

    @property
    def moments(self) -> MomentKind:
        """The registry's kind of AdamW's moments (Adafactor's state is priced and checked as float32's)."""
        return moment_kind(self.moment)

    @property
    def bits(self) -> int | None:
        """Bits per stored moment value where the moments are block-quantized, else None."""
        return self.moments.bits if self.name == "adamw" else None

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def label(self) -> str:
        if self.name == "adafactor":
            return "Adafactor (factored fp32 second moment, no first moment)"
        return self.moments.label(self.block)

    @property
    def checkpoint_id(self) -> str:
        """'adamw/int8/2048', 'adamw/float32', 'adafactor/float32': the optimizer state's form in a checkpoint."""
        return "/".join([self.name, self.moment] + ([str(self.block)] if self.block else []))

    def restores(self, saved_id: str) -> bool:
        """Whether a checkpoint whose state `saved_id` names restores into this one: the same form, or AdamW's
        unquantized moments of any float dtype (they convert on restore, as any dtype does)."""
        if saved_id == self.checkpoint_id:
            return True
        name, _, moment = saved_id.partition("/")
        floats = name == self.name == "adamw" and moment in _FLOAT_NAMES
        return floats and not self.quantized

    @property
    def host_update_seconds_per_param(self) -> float:
        """The host update's estimated seconds per trained parameter (Adafactor priced as fp32 AdamW)."""
        return moment_kind("float32" if self.name == "adafactor" else self.moment).host_update_rate

    @property
    def fused_host(self) -> bool:
        """Whether the one-pass host AdamW kernel runs this state (kernels.host_update=fused)."""
        return self.name == "adamw" and self.moments.fused_host

    def moment_bytes_per_value(self) -> tuple[float, float]:
        """(m, v) bytes per value of a large tensor: a float moment's itemsize; a quantized one's code bits
        plus its block's fp32 scale; Adafactor's factored rows and columns (4 bytes per row and per column,
        about 0 per value) and no m. Exact figures per tensor come from the state's own shapes
        (jaxmem.core.accounting.opt_state_bytes); this is for the per-leaf peaks of a streamed update."""
        if self.name == "adafactor":
            return 0, 0
        per = self.moments.bytes_per_value(self.block)
        return per, per

    def cuts(self, shape: tuple[int, ...], axis: int, count: int) -> bool:
        """Whether a leaf's state can be updated in `count` equal pieces along `axis` of its param: not
        Adafactor's (its factored rows and columns mix the pieces); a quantized one not along the last dim,
        where its blocks run (a piece's codes and scales along a leading dim are the whole's rows)."""
        if count == 1:
            return True
        if self.name == "adafactor":
            return False
        return not (self.quantized and quantizes(shape, self.moments.threshold)) or axis != len(shape) - 1


def state_kind(cfg: Config) -> StateKind:
    """The optimizer state `cfg` keeps: what every part outside jaxmem.optim asks about it."""
    return StateKind.from_config(cfg)


_FLOAT_NAMES = frozenset(kind.name for kind in KINDS if not kind.quantized)
