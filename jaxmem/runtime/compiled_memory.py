"""What XLA says a compiled executable holds: its memory analysis per device (device and pinned-host bytes
apart), and the warnings XLA logs while compiling a program over its memory budget."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile

DEVICE_FIELDS = ("argument", "output", "alias", "temp", "generated_code")
HOST_FIELDS = ("host_argument", "host_output", "host_alias", "host_temp", "host_generated_code")
# XLA messages that mean the program is over the memory budget (or was reshaped because of it).
WARNING_PATTERNS = (
    re.compile(r"exceeds the base limit"),
    re.compile(r"Can't reduce memory use below"),
    re.compile(r"hlo_rematerialization.*(?:memory|limit)", re.I),
    re.compile(r"gpu_hlo_schedule.*memory", re.I),
    re.compile(r"(?:RESOURCE_EXHAUSTED|[Oo]ut of memory)"),
)


def read_fields(compiled) -> dict[str, int]:
    """XLA's per-device memory analysis of a compiled executable, device and pinned-host bytes apart."""
    ma = compiled.memory_analysis()
    return {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in DEVICE_FIELDS + HOST_FIELDS}


def device_bytes(f: dict[str, int]) -> int:
    """Bytes a step holds on each device: its arguments and outputs (donated ones counted once) and temps."""
    return f["argument"] + f["output"] - f["alias"] + f["temp"]


def host_bytes(f: dict[str, int]) -> int:
    return f["host_argument"] + f["host_output"] - f["host_alias"] + f["host_temp"]


def memory_figures(compiled) -> dict[str, int]:
    """`read_fields` plus the totals, as "device" and "host"."""
    f = read_fields(compiled)
    return dict(f, device=device_bytes(f), host=host_bytes(f))


@contextlib.contextmanager
def captured_stderr():
    """Redirects file descriptor 2 (where XLA's C++ logging goes) into a list of lines."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode(errors="replace").splitlines())


def memory_warnings(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        if any(p.search(line) for p in WARNING_PATTERNS):
            text = re.sub(r"^[EWI]\d{4} [\d:.]+\s+\d+\s+", "", line.strip())  # drop the glog prefix
            if text not in out:
                out.append(text)
    return out
