"""Compile the real train step for a topology and read XLA's memory analysis, capturing the C++ log
(over-budget and rematerialization warnings) that a compile prints instead of failing."""
from __future__ import annotations

import dataclasses
import time

import jax

from jaxmem.runtime import compat
from jaxmem.runtime.aot import Topology
from jaxmem.runtime.compiled_memory import captured_stderr, device_bytes, host_bytes, memory_warnings, read_fields
from jaxmem.config.schema import Config
from jaxmem.registry import build_program
from jaxmem.plan import compile_failure, figure_cache
from jaxmem.kernels.attention.cudnn import backward_workspace_bytes

class _Totals:
    """Device and host totals of a compiled program's memory analysis `fields`."""

    fields: dict[str, int]
    compile_seconds: float

    @property
    def device_total(self) -> int:
        return device_bytes(self.fields)

    @property
    def host_total(self) -> int:
        return host_bytes(self.fields)

    def _json(self) -> dict:
        return {**{k: int(v) for k, v in self.fields.items()}, "device_total": int(self.device_total),
                "host_total": int(self.host_total), "compile_seconds": round(self.compile_seconds, 2)}


@dataclasses.dataclass
class InitFigures(_Totals):
    """memory_analysis() of the compiled program that builds the step-0 state (from `source`), per device."""

    fields: dict[str, int]
    compile_seconds: float
    source: str  # "train.seed" or "checkpoint.init_from"
    label: str

    def to_json(self) -> dict:
        return {**self._json(), "source": self.source, "label": self.label}


@dataclasses.dataclass
class CompiledFigures(_Totals):
    """memory_analysis() of the compiled step, per device; device and host bytes kept apart; `init`: the
    program that builds the step-0 state (None: not compiled)."""

    fields: dict[str, int]
    warnings: list[str]
    compile_seconds: float
    label: str
    jax_version: str = ""  # the XLA that compiled it decides the figure (offload_version_warning)
    init: InitFigures | None = None

    @property
    def run_device_peak(self) -> int:
        """The larger of the step's and the init's device totals: what a run needs on each device."""
        return max(self.device_total, self.init.device_total if self.init else 0)

    def to_json(self) -> dict:
        return {**self._json(), "label": self.label, "jax": self.jax_version,
                "init": self.init.to_json() if self.init else None}


def compile_for_plan(cfg: Config, topo: Topology, init: bool = True):
    """(compiled executable, figures) for the train step of `cfg` on `topo`: builds the program for the
    topology's (compile-only) devices, compiles it and reads its memory analysis and XLA's memory warnings;
    `init`: the program that builds the step-0 state too (figures.init). With the figure cache on
    (jaxmem.plan.figure_cache) a deviceless compile of the same lowered step for the same target earlier gives
    the figures, and the executable is None."""
    start = time.perf_counter()
    with captured_stderr() as lines:
        prog = build_program(cfg, devices=list(topo.devices()))
    with compile_failure.one_line(cfg, _target(topo), prog.layout.kernels):
        with captured_stderr() as more:
            lowered = prog.lower()
        compiled, fields, xla_warnings, seconds = _figures(lowered, topo, start, lines + more)
    warnings = list(xla_warnings)
    if topo.name and prog.layout.kernels["attention"] == "cudnn":
        warnings.append(cudnn_workspace_warning(cfg, prog.layout))
    old_xla = offload_version_warning(jax.__version__, host_bytes(fields))
    warnings += [old_xla] if topo.name and old_xla else []
    figures = CompiledFigures(fields, warnings, seconds, _label(topo), jax.__version__,
                              init=compile_init(prog, topo) if init else None)
    return compiled, figures


def compile_init(prog, topo: Topology) -> InitFigures | None:
    """The figures of the program that builds the run's step-0 state (TrainProgram.lower_init); None where a
    plug-in loads it outside one program."""
    start = time.perf_counter()
    with compile_failure.one_line(prog.cfg, _target(topo), prog.layout.kernels):
        with captured_stderr() as lines:
            lowered = prog.lower_init()
        if lowered is None:
            return None
        fields, seconds = _figures(lowered, topo, start, lines)[1::2]
    source = "checkpoint.init_from" if prog.cfg.checkpoint.init_from else "train.seed"
    return InitFigures(fields, seconds, source, _label(topo))


def _target(topo: Topology) -> str:
    return f"{topo.label} {'(deviceless)' if topo.name else '(attached devices)'}"


def _label(topo: Topology) -> str:
    return f"compiled for {topo.label} {'(deviceless)' if topo.name else '(attached devices)'}"


def _figures(lowered, topo: Topology, start: float, lines: list[str]):
    """(executable or None, memory analysis fields, XLA's memory warnings, seconds since `start`) of `lowered`
    compiled for `topo`; from the figure cache where it holds the same compile (executable None)."""
    compiled = hit = cache_key = None
    if topo.name and figure_cache.directory() is not None:
        cache_key = figure_cache.key(lowered.as_text(), f"{topo.label}\n{topo.gpu.target_config_text()}")
        hit = figure_cache.lookup(cache_key)
    if hit is not None:  # the figures of the same compile, made earlier
        return None, hit["fields"], hit["warnings"], hit["compile_seconds"]
    with captured_stderr() as more:
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    fields, xla_warnings = read_fields(compiled), memory_warnings(lines + more)
    if cache_key:
        figure_cache.store(cache_key, fields, xla_warnings, seconds)
    return compiled, fields, xla_warnings, seconds


def offload_version_warning(jax_version: str, host: int) -> str | None:
    """The XLA of jax 0.10 and the one of jax 0.11 schedule host-offload programs differently; without host
    buffers both versions agree with the GPU (benchmarks/plan_accuracy.md; benchmarks/constants.md, compiled)."""
    if not host or compat.version_tuple(jax_version) >= (0, 11, 0):
        return None
    return (f"planned with jax {jax_version}, whose XLA schedules host-offload programs differently from jax "
            f"0.11's (the 1-GPU 128k offload recipe: 32.35 GiB with jax 0.10.2, 37.45 with jax 0.11.2, 39.11 "
            f"measured on an H100 with jax 0.11.2); plan with the jax that will run")


def cudnn_workspace_warning(cfg: Config, layout) -> str:
    """What a deviceless compile of cuDNN attention leaves out (docs/attention.md), estimated per device."""
    m = cfg.model
    rows_heads = layout.per_device_elems(("act_batch", "act_heads"), (layout.rows, m.n_heads))
    workspace = backward_workspace_bytes(rows_heads, cfg.train.seq_len, 1, m.head_dim)
    return (f"cuDNN attention: a deviceless compile does not count its backward workspace, about "
            f"{workspace / 2**30:.2f} GiB per device (estimated: 2 x B x T x N x H x 4 bytes, one layer at a "
            f"time); the device peak can be up to that much above the compiled figure")

