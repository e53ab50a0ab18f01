"""A run on a machine without a GPU: XLA's CPU device count and thread pool set before jax's backend starts, and
jax started without the CUDA plugin's chatter.

Everything here acts before the backend exists (XLA reads XLA_FLAGS and NPROC once, when it creates the CPU
client), so jax is imported lazily: `jaxmem --help` loads none of it.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys

from jaxmem.config.schema import ConfigError, ParallelConfig

DEVICE_COUNT = "--xla_force_host_platform_device_count"
_DEVICE_COUNT_FLAG = re.compile(re.escape(DEVICE_COUNT) + r"=(\d+)")
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
THREADS_PER_DEVICE = 8  # collectives one device may have waiting at once, with room to spare


def has_gpu() -> bool:
    """An NVIDIA driver is loaded here (a Linux host's /proc entry, a WSL host's GPU device)."""
    return any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidia0", "/dev/dxg"))


def on_cpu() -> bool:
    """jax runs on its CPU backend here: JAX_PLATFORMS names cpu first, or there is no GPU."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if "jax" in sys.modules:
        platforms = platforms or (sys.modules["jax"].config.jax_platforms or "")
    return platforms.split(",")[0] == "cpu" or not has_gpu()


@contextlib.contextmanager
def quiet_native_stderr():
    """Silences everything written to fd 2 meanwhile: C++ logging included (the CUDA plugin's "Could not find
    cuda drivers" lines on a host without a GPU), which Python's own redirection does not reach."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def start_jax_quietly() -> None:
    """On a host without a GPU, imports jax and registers its plugins with fd 2 silenced: an installed CUDA plugin
    logs from C++ on import and again when it is registered (and a traceback where JAX_PLATFORMS allows cuda).
    Registering starts no backend, so XLA_FLAGS may still change afterwards. Elsewhere nothing is hidden."""
    if has_gpu() or "jax" in sys.modules:
        return
    with quiet_native_stderr():
        import jax  # noqa: F401 (lazy: the point is to import it here, silenced)
        from jax._src import xla_bridge  # lazy: as jax

        register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if register is not None:
            register()


def scheduler_flag() -> None:
    """On a CPU-only host, switches off XLA's concurrency-optimized CPU scheduler before the backend starts.

    With it (jax 0.10.2) a multi-device CPU program can run two independent collectives in a different order
    on different devices; they wait on each other until XLA's rendezvous timeout aborts the process (seen in
    `jaxmem train` with sp=4 x fsdp=2 under load, and in the tests: tests/conftest.py). An XLA_FLAGS that names
    the flag itself wins. GPU hosts are left alone (the flag only concerns the CPU backend).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if on_cpu() and "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()


def requested_devices() -> int | None:
    """The CPU device count XLA_FLAGS or JAX_NUM_CPU_DEVICES asks for; None where neither does."""
    found = _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
    if found:
        return int(found[-1])
    count = os.environ.get("JAX_NUM_CPU_DEVICES", "")
    return int(count) if count.strip().isdigit() else None


def thread_pool() -> None:
    """On a CPU-only host with several virtual devices, gives XLA's CPU thread pool room for the collectives that
    wait in it, before the backend starts.

    XLA:CPU (jax 0.10.2) runs the independent operations of one program concurrently on a thread pool that
    every virtual device shares, and a collective holds its thread until all devices have joined it. When a
    step has two collectives that do not depend on each other (an all-gather inside the layer scan, and the LM
    head's all-gather beside the scan), some devices enter one and the rest the other; once every pool thread
    is taken by a waiting device, the devices that would complete either collective never get a thread, and
    XLA's rendezvous timeout aborts the process. The pool is sized by NPROC (else the core count); with
    THREADS_PER_DEVICE threads per device no collective waits for a thread. Waiting threads cost no CPU. An
    NPROC already set wins; GPU hosts and one-device runs are left alone.
    """
    if has_gpu() or "NPROC" in os.environ:
        return
    devices = requested_devices() or 1
    if devices > 1:
        os.environ["NPROC"] = str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * devices))


def mesh_devices(parallel: ParallelConfig) -> tuple[int, bool]:
    """(devices the mesh's fixed axes take, whether an axis is -1 and fills whatever count there is)."""
    sizes = (parallel.dp, parallel.fsdp, parallel.ep, parallel.sp, parallel.tp)
    return math.prod(s for s in sizes if s != -1) * parallel.pp, -1 in sizes


def _backend_devices() -> int | None:
    """The device count of jax's running backend; None before it starts."""
    if "jax" not in sys.modules:
        return None
    from jax._src import xla_bridge  # lazy: only once jax is imported anyway

    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)()
    return sys.modules["jax"].local_device_count() if started else None


def give_mesh_its_devices(parallel: ParallelConfig, processes: int = 1) -> None:
    """On the CPU backend, before it starts: sets XLA's host device count to what the mesh takes (per process).

    A mesh whose axes are all fixed gets exactly its size; one with a -1 axis gets its fixed axes' product,
    so the -1 axis is 1 unless the count set by the user (XLA_FLAGS, JAX_NUM_CPU_DEVICES) is larger (with no
    fixed axis beyond the -1 one, jax's default, one device, stays). Where the count cannot be set (the
    backend has started, or the user set another one that the mesh cannot take), a one-line ConfigError says
    which flag to set. GPU hosts are left alone.
    """
    need, fills = mesh_devices(parallel)
    if not on_cpu() or need % processes:
        return
    need //= processes
    fits = (lambda n: n % need == 0) if fills else (lambda n: n == need)
    running = _backend_devices()
    if running is not None:
        if not fits(running):
            raise ConfigError(f"parallel: the mesh takes {need} CPU devices but jax's backend already started with "
                              f"{running}; set XLA_FLAGS={DEVICE_COUNT}={need} before jax starts")
        return
    asked = requested_devices()
    if asked is not None:
        if not fits(asked):
            where = "XLA_FLAGS" if _DEVICE_COUNT_FLAG.search(os.environ.get("XLA_FLAGS", "")) else \
                "JAX_NUM_CPU_DEVICES"
            raise ConfigError(f"parallel: the mesh takes {need} CPU devices but {where} asks for {asked}; set "
                              f"XLA_FLAGS={DEVICE_COUNT}={need} (or unset it: jaxmem then sets it)")
        return
    if need > 1:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DEVICE_COUNT}={need}".strip()
        thread_pool()
