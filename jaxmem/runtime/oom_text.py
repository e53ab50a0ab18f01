"""Whether an error is the devices (or the host) running out of memory, from its text alone. A leaf: the
training loop, checkpoint restores and the OOM forensics (jaxmem.plan.oom, which lists the message forms
and where each comes from) all ask it."""
from __future__ import annotations

_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "out of device memory")


_NOT_MEMORY = ("No space left on device", "not enough disk")  # RESOURCE_EXHAUSTED of a full disk, not memory


def is_oom(exc: BaseException) -> bool:
    """The error is the devices (or the host) running out of memory, in any of jaxmem.plan.oom's forms (a full
    disk, which tensorstore also calls RESOURCE_EXHAUSTED, is not)."""
    text = f"{type(exc).__name__} {exc}"
    return any(s in text for s in _MARKERS) and not any(s in text for s in _NOT_MEMORY)
