"""Builds host_adamw.cc with the machine's C++ compiler on first use and registers it with XLA's FFI (a CPU
program's, or the CUDA plugin's for a GPU program's host computation).

As DeepSpeed builds its CPU Adam: no binary ships with jaxmem. The shared library is cached under
~/.cache/jaxmem/kernels (JAXMEM_KERNEL_CACHE overrides), keyed by the source, the compiler's version, the
flags, jaxlib's FFI headers and this CPU's model and flags (the build targets -march=native), so a home
directory shared by machines of different CPUs holds one library per kind. The write is atomic (a temporary
file renamed into place), so two processes building at once both load a whole library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

SOURCE = Path(__file__).with_name("host_adamw.cc")
TARGET = "jaxmem_host_adamw"
SYMBOL = "JaxmemHostAdamW"
LOWBIT_TARGET = "jaxmem_host_adamw_lowbit"  # m and v block-quantized
LOWBIT_SYMBOL = "JaxmemHostAdamWLowbit"
# -ffp-contract=fast: multiply-adds fused as XLA:CPU fuses them (m' then equals optax's under XLA, bit for bit);
# -fno-math-errno lets the square root vectorize, -fno-trapping-math the clamps of a code (floating-point
# exceptions are never read; every value is the same). No -ffast-math: NaN and inf keep their IEEE behaviour.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast", "-std=c++17",
         "-fPIC", "-shared", "-pthread", "-w")


class BuildError(RuntimeError):
    """The kernel could not be built or loaded here; the message says why in one line."""


def compiler() -> str | None:
    """$CXX where set (None if it names no program), else the first of c++, g++, clang++ on the PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def cache_dir() -> Path:
    return Path(os.environ.get("JAXMEM_KERNEL_CACHE") or Path.home() / ".cache" / "jaxmem" / "kernels")


def _cpu_signature() -> str:
    """The CPU's model and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    headers = Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api"
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_signature().encode(),
                 *(p.read_bytes() for p in sorted(headers.glob("*.h")))):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:20]


def library_path() -> Path:
    """The built library, compiled now if the cache lacks it. BuildError if no compiler or the build fails."""
    cxx = compiler()
    if cxx is None:
        raise BuildError("no C++ compiler ($CXX, c++, g++ or clang++) to build the fused host AdamW kernel")
    path = cache_dir() / f"host_adamw-{_key(cxx)}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".host_adamw-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or ["(no output)"]
            first_error = next((line for line in lines if "error" in line), lines[-1])
            raise BuildError(f"building {SOURCE.name} with {cxx} failed: {first_error.strip()}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def register(platform: str = "cpu") -> str:
    """Builds (once per machine), loads and registers the kernels (fp32 and block-quantized moments); returns
    the fp32 one's FFI target name. `platform` "cpu": for CPU programs (jaxlib's registry); "gpu": for the host
    computations of GPU programs (the CUDA plugin's registry, platform Host: jaxmem.runtime.pjrt_ffi).
    BuildError where it cannot."""
    try:
        library = ctypes.cdll.LoadLibrary(str(library_path()))
    except OSError as e:
        raise BuildError(f"loading the fused host AdamW kernel failed: {e}") from e
    handlers = {TARGET: getattr(library, SYMBOL), LOWBIT_TARGET: getattr(library, LOWBIT_SYMBOL)}
    if platform == "cpu":
        for target, handler in handlers.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
        return TARGET
    from jaxmem.runtime import compat, pjrt_ffi  # lazy: only a GPU program's update reaches the plugin

    try:
        for target, handler in handlers.items():
            pjrt_ffi.register_host_handler(target, ctypes.cast(handler, ctypes.c_void_p).value)
    except (pjrt_ffi.PluginUnavailable, compat.UnsupportedVersion) as e:
        raise BuildError(f"registering the fused host AdamW kernel for a GPU program's host: {e}") from e
    return TARGET
