"""The optimizer state kinds: how AdamW keeps its moments m and v (`precision.moment_dtype`), one object each.

Each `MomentKind` says what every other part of jaxmem asks about a kind: its bytes per value, its block and
threshold, the host update's estimated rate, whether its state shards like the params, its label and checkpoint
id, its config rule, whether tune may pick it (lossy) and whether the fused host kernel runs it. Importing this
module registers the kinds' names, descriptions and rules with the schema (`jaxmem.config.schema.register_choice`),
so the allowed values of `precision.moment_dtype`, its help and docs/optimizers.md's table come from here. A new
kind is one more `MomentKind` in KINDS (and its storage: a float dtype, or codes in jaxmem.optim.codes).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxmem.config.schema import Config, ConfigError, register_choice
from jaxmem.optim import codes

KEY = "precision.moment_dtype"
# Tensors under this many values (and vectors) keep fp32 moments in every quantized kind (bitsandbytes'
# min_8bit_size): a few bytes, and the most sensitive to rounding.
THRESHOLD = 4096
# The host update's seconds per trained parameter (offload.optimizer_update=host: jaxmem.optim.host_update
# under XLA host compute), serial after the backward. Estimated from the update alone measured on one GPU
# machine's host CPU (scripts/bench_host_update.py --platform cuda; benchmarks/host_update_gpu_host.md,
# benchmarks/constants.md); another host's cores and memory bandwidth give another rate.
FLOAT_HOST_RATE = 2.65e-9
CODED_HOST_RATE = 4.9e-9


@dataclasses.dataclass(frozen=True)
class MomentKind:
    name: str  # the value of precision.moment_dtype
    summary: str  # what it is, for the schema's help and the docs' table (one clause, no figures of its own)
    host_update_rate: float  # estimated seconds per parameter of the host update (see above)
    dtype: Any = None  # float kinds: the moments' dtype
    codes: tuple[str, str] | None = None  # quantized kinds: (m's code, v's code), names in jaxmem.optim.codes
    default_block: int = 0  # quantized kinds: values per block along a tensor's last dim
    block_multiple: int = 1  # a block must be a multiple of this (4-bit codes pair values in a byte)
    tune_may_pick: bool = False  # tune tries it under --allow-lossy-optimizer (a lossy kind: its numerics differ)
    fused_host: bool = False  # kernels.host_update=fused runs it (jaxmem.kernels.host_adamw)
    shards: bool = True  # its m and v follow the param's partition spec (ZeRO shards them; jaxmem.optim.specs)
    with_adafactor: bool = False  # optimizer.name=adafactor takes it (Adafactor keeps its own fp32 state)
    threshold: int = THRESHOLD  # quantized kinds: smaller tensors keep fp32 moments

    @property
    def quantized(self) -> bool:
        return self.codes is not None

    @property
    def bits(self) -> int | None:
        """Bits per stored value of a quantized kind's codes, else None."""
        return codes.CODES[self.codes[0]].bits if self.quantized else None

    def block(self, moment_block: int) -> int:
        """The block a run uses (precision.moment_block, 0 for the default); 0 for a float kind."""
        return (moment_block or self.default_block) if self.quantized else 0

    def bytes_per_value(self, block: int) -> float:
        """m's (or v's) bytes per value of a large tensor: a float's itemsize; codes' bits plus a block's fp32
        scale."""
        if self.quantized:
            return self.bits / 8 + 4 / block
        return jnp.dtype(self.dtype).itemsize

    def label(self, block: int) -> str:
        if self.quantized:
            return (f"AdamW, {self.name} moments in blocks of {block} (fp32 for vectors and tensors under "
                    f"{self.threshold} values)")
        return f"AdamW, {self.name} moments"

    def describe(self) -> str:
        """The one-line description the schema's help and docs/config.md give this value."""
        if not self.quantized:
            return f"{self.name} ({self.summary})"
        return (f"{self.name} ({self.summary}; blocks of {self.default_block} by default, a per-block fp32 scale; "
                f"vectors and tensors under {self.threshold} values stay float32; lossy)")

    def check(self, cfg: Config) -> None:
        """This kind's config rule: its block, and whether the optimizer takes it."""
        block = cfg.precision.moment_block
        if block and not self.quantized:
            raise ConfigError(f"precision.moment_block: blocks are for quantized moments "
                              f"({', '.join(k.name for k in KINDS if k.quantized)}); moment_dtype is {self.name}")
        if block % self.block_multiple:
            raise ConfigError(f"precision.moment_block: {self.name} moments need a multiple of "
                              f"{self.block_multiple} (codes pair values in a byte), got {block}")
        if cfg.optimizer.name == "adafactor" and not self.with_adafactor:
            raise ConfigError(f"precision.moment_dtype: {self.name} is for AdamW's moments; optimizer.name="
                              "adafactor keeps its factored second moment in float32")


KINDS: tuple[MomentKind, ...] = (
    MomentKind("float32", "4 bytes per value for m and v each", FLOAT_HOST_RATE, dtype=jnp.float32,
               fused_host=True, with_adafactor=True),
    MomentKind("bfloat16", "2 bytes per value each", FLOAT_HOST_RATE, dtype=jnp.bfloat16),
    # bitsandbytes' 8-bit dynamic tree codes in blocks of 2048 (arXiv 2110.02861)
    MomentKind("int8", "dynamic 8-bit codes, 1 byte per value each", CODED_HOST_RATE,
               codes=("dynamic8_signed", "dynamic8_unsigned"), default_block=2048, tune_may_pick=True, fused_host=True),
    # 4-bit AdamW (arXiv 2309.01507): blocks of 128, a linear code of sqrt(v) without zero
    MomentKind("int4", "4-bit codes, half a byte per value each", CODED_HOST_RATE,
               codes=("dynamic4_signed", "linear_square4"), default_block=128, block_multiple=2, tune_may_pick=True,
               fused_host=True),
    # e4m3 values with a per-block scale, torchao's AdamWFp8 (blocks of 256). Tune does not pick it: int8 is
    # as small (its larger blocks make it smaller) and tune tries int8. Its host rate is not measured: int8's.
    MomentKind("float8", "float8 e4m3 values, 1 byte per value each", CODED_HOST_RATE,
               codes=("e4m3_signed", "e4m3_unsigned"), default_block=256),
)
BY_NAME = {kind.name: kind for kind in KINDS}


def moment_kind(name: str) -> MomentKind:
    """The kind named `name` (a precision.moment_dtype value); a one-line ConfigError for an unknown one."""
    if name not in BY_NAME:
        raise ConfigError(f"{KEY}: {name!r} is not allowed; use one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def host_update_rates() -> dict[str, float]:
    """Each kind's estimated host-update seconds per parameter, by name (the cost model's constants report)."""
    return {kind.name: kind.host_update_rate for kind in KINDS}


DOCS = Path(__file__).resolve().parents[2] / "docs" / "optimizers.md"
DOCS_BEGIN = "<!-- the state kinds: jaxmem.optim.states.docs_table -->"
DOCS_END = "<!-- end of the state kinds -->"
REGENERATE = "python -c 'from jaxmem.optim import states; states.write_docs()'"


def docs_table() -> str:
    """docs/optimizers.md's table of the kinds, between DOCS_BEGIN and DOCS_END (tests/unit/test_optim_states.py
    keeps it in step)."""
    rows = ["| `precision.moment_dtype` | m + v bytes per value (large tensors) | default block | tune may pick it "
            "| shards | `kernels.host_update=fused` | host update, s per parameter (estimated) |",
            "|---|---|---|---|---|---|---:|"]
    for kind in KINDS:
        block = kind.default_block
        per = 2 * kind.bytes_per_value(block)
        size = f"{per:g}" if not kind.quantized else f"{2 * kind.bits / 8:g} + 8 / block = {per:.4g}"
        flags = " | ".join("yes" if flag else "no" for flag in (kind.tune_may_pick, kind.shards, kind.fused_host))
        rows.append(f"| `{kind.name}` | {size} | {block or '-'} | {flags} | {kind.host_update_rate:.3g} |")
    return "\n".join(rows) + "\n"


def with_docs_table(text: str) -> str:
    """`text` (docs/optimizers.md) with the table between its markers replaced by docs_table()."""
    head, begin, rest = text.partition(DOCS_BEGIN)
    _, end, tail = rest.partition(DOCS_END)
    if not (begin and end):
        raise ValueError(f"{DOCS}: the markers {DOCS_BEGIN} and {DOCS_END} are missing")
    return head + DOCS_BEGIN + "\n" + docs_table() + DOCS_END + tail


def write_docs(path: Path = DOCS) -> None:
    path.write_text(with_docs_table(path.read_text()))


for _kind in KINDS:
    register_choice(KEY, _kind.name, _kind.describe(), _kind.check)
