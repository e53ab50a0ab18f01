"""`jaxmem` command line: each subcommand lives in its own module's `main(argv)`."""
from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys

from jaxmem.version import __version__

COMMANDS = {
    "train": ("jaxmem.cli.train", "run a config-driven training run"),
    "plan": ("jaxmem.cli.plan", "per-device memory bill for a target GPU (deviceless compile)"),
    "explain": ("jaxmem.cli.explain", "which source lines own the biggest buffers at the peak"),
    "bench": ("jaxmem.cli.bench", "run the train step here: planned vs measured memory, step time, MFU"),
    "sweep": ("jaxmem.cli.sweep", "plan the cross product of config overrides"),
    "tune": ("jaxmem.cli.tune", "walk the memory decision flow for a target; write the fastest config that fits"),
    "data": ("jaxmem.cli.data_cmd", "preview the training data: a rendered sample, its loss mask, packing stats"),
    "import-hf": ("jaxmem.cli.import_hf", "convert a Hugging Face checkpoint into an orbax params checkpoint"),
    "merge-lora": ("jaxmem.cli.merge_lora", "a LoRA run's checkpoint as a merged Hugging Face checkpoint (+ PEFT)"),
    "export-hf": ("jaxmem.cli.export_hf", "a run's checkpoint as a Hugging Face folder with its tokenizer (LoRA merged)"),
    "config": ("jaxmem.cli.config_cmd:config_main", "print a resolved config as YAML, each key with its description"),
    "list": ("jaxmem.cli.config_cmd:list_main", "list model presets, remat presets and names, GPU targets, kernels"),
    "doctor": ("jaxmem.cli.doctor", "check this machine for a run: devices, versions, allocator env, host RAM"),
}


def _usage() -> str:
    lines = ["usage: jaxmem COMMAND [args]   (jaxmem COMMAND --help: its options and examples)", "",
             "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "options:", "  -h, --help     this list", "  -V, --version  jaxmem's and jax's versions", "",
              "config reference: docs/config.md, `jaxmem config CONFIG`, `jaxmem list`"]
    return "\n".join(lines)


def _entry(name: str):
    """The `main(argv)` of a command: "module" (its main) or "module:function"."""
    module, _, func = COMMANDS[name][0].partition(":")
    return getattr(importlib.import_module(module), func or "main")


@contextlib.contextmanager
def _quiet_native_stderr():
    """Silences C++ logging on fd 2 (the CUDA plugin's "Could not find cuda drivers" lines on CPU hosts)."""
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


CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _cpu_scheduler_flag() -> None:
    """On a CPU-only host, switch off XLA's concurrency-optimized CPU scheduler before the backend starts.

    With it (jax 0.10.2) a multi-device CPU program can run two independent collectives in a different order
    on different devices; they wait on each other until XLA's 40 s rendezvous timeout aborts the process
    (seen in `jaxmem train` with sp=4 x fsdp=2 under load, and in the tests: tests/conftest.py). An XLA_FLAGS
    that names the flag itself wins. GPU hosts are left alone (the flag only concerns the CPU backend).
    """
    platforms = os.environ.get("JAX_PLATFORMS", "")
    on_cpu = platforms.split(",")[0] == "cpu" or not os.path.exists("/proc/driver/nvidia")
    flags = os.environ.get("XLA_FLAGS", "")
    if on_cpu and "xla_cpu_enable_concurrency_optimized_scheduler" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()


_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")
THREADS_PER_DEVICE = 8  # collectives one device may have waiting at once, with room to spare


def _cpu_thread_pool() -> None:
    """On a CPU-only host with several virtual devices, give XLA's CPU thread pool room for the collectives
    that wait in it, before the backend starts.

    XLA:CPU (jax 0.10.2) runs the independent operations of one program concurrently on a thread pool that
    every virtual device shares, and a collective holds its thread until all devices have joined it. When a
    step has two collectives that do not depend on each other (an all-gather inside the layer scan, and the LM
    head's all-gather beside the scan), some devices enter one and the rest the other; once every pool thread
    is taken by a waiting device, the devices that would complete either collective never get a thread, and
    XLA's 40 s rendezvous timeout aborts the process. The pool is sized by NPROC (else the core count); with
    THREADS_PER_DEVICE threads per device no collective waits for a thread. Waiting threads cost no CPU. An
    NPROC already set wins; GPU hosts and one-device runs are left alone.
    """
    if os.path.exists("/proc/driver/nvidia") or "NPROC" in os.environ:
        return
    found = _DEVICE_COUNT_FLAG.findall(os.environ.get("XLA_FLAGS", ""))
    devices = int(found[-1]) if found else int(os.environ.get("JAX_NUM_CPU_DEVICES", "1") or 1)
    if devices > 1:
        os.environ["NPROC"] = str(max(os.cpu_count() or 1, THREADS_PER_DEVICE * devices))


def version_text() -> str:
    import jax
    import jaxlib

    return f"jaxmem {__version__} (jax {jax.__version__}, jaxlib {jaxlib.__version__})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        with contextlib.nullcontext() if os.path.exists("/proc/driver/nvidia") else _quiet_native_stderr():
            print(version_text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxmem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    _cpu_scheduler_flag()
    _cpu_thread_pool()
    if not os.path.exists("/proc/driver/nvidia"):  # no GPU here: the plugin's import chatter is noise
        with _quiet_native_stderr():
            import jax  # noqa: F401
    entry = _entry(name)
    from jaxmem.config.schema import ConfigError  # lazy: after the CPU flags are set and jax's start is quieted
    from jaxmem.runtime.compat import UnsupportedVersion  # lazy: as ConfigError

    try:
        return entry(rest) or 0
    except ConfigError as e:
        print(f"jaxmem {name}: config error: {e}", file=sys.stderr)
        return 2
    except UnsupportedVersion as e:
        print(f"jaxmem {name}: unsupported version: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
