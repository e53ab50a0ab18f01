"""The environment for a subprocess a test starts: the CPU platform, `devices` virtual devices, and the rest
of the suite's XLA flags (tests/conftest.py: the compile-time and scheduler choices) kept."""
import os

COUNT_FLAG = "--xla_force_host_platform_device_count"


def cpu_env(devices: int = 8, **extra: str) -> dict:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join([f"{COUNT_FLAG}={devices}", *flags]), **extra)
