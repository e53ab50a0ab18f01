"""Device-memory telemetry of `jaxmem train`: allocator stats next to the compiled step's figures.

At every metrics record, each local device's `memory_stats()` is read. Keys added to the record (bytes):

  mem/bytes_in_use, mem/peak_bytes_in_use    the largest value over this process's local devices
  mem/bytes_limit, mem/largest_free_block_bytes   the smallest value over the local devices (the tightest)
  mem/<stat>_per_device                      the per-device values, in `jax.local_devices()` order
  plan/argument_bytes                        the compiled step's argument bytes per device (the state + batch)
  plan/device_bytes                          the compiled step's device total (`runtime.compiled_memory.device_bytes`)
  mem/warnings                               names of the warnings first raised at this record (see below)

A stat the backend does not report is left out; where no device reports any (CPU: memory_stats() is
None) none of these keys is written and the plan/* figures are left out too. Only the scalars reach
TensorBoard (as train/mem/..., train/plan/...); the lists and warning names are in metrics.jsonl only.

Warnings, each printed once per run and listed in the run summary's `memory_warnings` (name -> text):
  leak           between steps, bytes_in_use exceeds the compiled argument bytes by more than LEAK_MARGIN
  peak           peak_bytes_in_use exceeds the compiled device total by more than PEAK_MARGIN
  fragmentation  largest_free_block_bytes is below FRAGMENTATION_RATIO of (bytes_limit - bytes_in_use)

`save_memory_profile` writes `jax.profiler.device_memory_profile()` (pprof format, `pprof -http`) to
`<out_dir>/memory_profile_step<N>.prof` (train.memory_profile_at=N).
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax

from jaxmem.io.no_follow import write_bytes
from jaxmem.runtime.compiled_memory import device_bytes, read_fields

STATS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "largest_free_block_bytes")
_WORST = {"bytes_in_use": max, "peak_bytes_in_use": max, "bytes_limit": min, "largest_free_block_bytes": min}
LEAK_MARGIN, PEAK_MARGIN, FRAGMENTATION_RATIO = 0.05, 0.02, 0.5


def _note(text: str) -> None:
    print(f"jaxmem train: {text}", file=sys.stderr, flush=True)


def _local_devices() -> list:
    return jax.local_devices()


def compiled_figures(compiled) -> tuple[int | None, int | None]:
    """(argument bytes, device total) per device of a compiled step; (None, None) if XLA reports none."""
    try:
        fields = read_fields(compiled)
    except Exception:  # noqa: BLE001 - a backend without a memory analysis: no plan figures
        return None, None
    return fields["argument"], device_bytes(fields)


class MemoryTelemetry:
    """Reads the local devices' allocator stats at each `sample()` and raises each warning once."""

    def __init__(self, argument_bytes: int | None, device_total: int | None, devices=None, note=_note):
        self.argument_bytes, self.device_total = argument_bytes, device_total
        self.devices = list(_local_devices() if devices is None else devices)
        self.note = note
        self.warnings: dict[str, str] = {}

    @classmethod
    def for_compiled(cls, compiled, devices=None, note=_note) -> MemoryTelemetry:
        return cls(*compiled_figures(compiled), devices=devices, note=note)

    def _stats(self) -> list[dict]:
        out = []
        for d in self.devices:
            try:
                stats = d.memory_stats()
            except Exception:  # noqa: BLE001 - a backend that cannot report: same as None
                stats = None
            if stats:
                out.append({k: int(stats[k]) for k in STATS if k in stats})
        return out

    def sample(self) -> dict:
        """The mem/* and plan/* keys for a metrics record ({} where no device reports stats)."""
        per_device = self._stats()
        if not per_device:
            return {}
        record = {}
        for key in STATS:
            values = [s[key] for s in per_device if key in s]
            if values:
                record[f"mem/{key}"] = _WORST[key](values)
                record[f"mem/{key}_per_device"] = values
        if self.argument_bytes is not None:
            record["plan/argument_bytes"] = self.argument_bytes
            record["plan/device_bytes"] = self.device_total
        new = [name for name, text in self._check(per_device) if self._warn(name, text)]
        if new:
            record["mem/warnings"] = new
        return record

    def _check(self, per_device: list[dict]):
        for s in per_device:
            used, peak = s.get("bytes_in_use"), s.get("peak_bytes_in_use")
            limit, free_block = s.get("bytes_limit"), s.get("largest_free_block_bytes")
            if used is not None and self.argument_bytes and used > self.argument_bytes * (1 + LEAK_MARGIN):
                yield "leak", (f"{_gib(used)} in use between steps, more than the compiled step's "
                               f"{_gib(self.argument_bytes)} of arguments (+{LEAK_MARGIN:.0%}): buffers outlive "
                               "the step (a leak, or arrays kept from earlier steps)")
            if peak is not None and self.device_total and peak > self.device_total * (1 + PEAK_MARGIN):
                yield "peak", (f"peak {_gib(peak)} in use, more than the compiled step's device total "
                               f"{_gib(self.device_total)} (+{PEAK_MARGIN:.0%}): memory outside the step "
                               "(init, checkpoint copies, other arrays) sets the peak")
            if None not in (used, limit, free_block) and free_block < FRAGMENTATION_RATIO * (limit - used):
                yield "fragmentation", (f"largest free block {_gib(free_block)} is under half of the "
                                        f"{_gib(limit - used)} free: device memory is fragmented")

    def _warn(self, name: str, text: str) -> bool:
        if name in self.warnings:
            return False
        self.warnings[name] = text
        self.note(f"memory warning ({name}): {text}")
        return True


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def profile_path(out_dir: str | Path, step: int) -> Path:
    suffix = f".proc{jax.process_index()}" if jax.process_count() > 1 else ""
    return Path(out_dir) / f"memory_profile_step{step}{suffix}.prof"


def save_memory_profile(out_dir: str | Path, step: int, note=_note) -> Path | None:
    """Writes the device memory profile (pprof) of this process after `step`; None, with one line, if the
    backend cannot give one."""
    try:
        data = jax.profiler.device_memory_profile()
    except Exception as e:  # noqa: BLE001 - unsupported on this backend: say so and go on
        note(f"train.memory_profile_at={step}: no device memory profile on this backend ({type(e).__name__}: "
             f"{str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}); skipped")
        return None
    path = profile_path(out_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(path, data)  # never through a link
    note(f"device memory profile after step {step}: {path}")
    return path
