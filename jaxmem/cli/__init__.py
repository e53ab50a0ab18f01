"""`jaxmem` command line: each subcommand lives in its own module's `main(argv)`."""
from __future__ import annotations

import importlib
import sys

from jaxmem.config.schema import ConfigError
from jaxmem.runtime import cpu_host
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
    "generate": ("jaxmem.cli.generate", "complete prompts with a run's checkpoint or a Hugging Face folder"),
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


# the CPU host's settings, by the names the tests and scripts know them
_quiet_native_stderr = cpu_host.quiet_native_stderr
_cpu_scheduler_flag = cpu_host.scheduler_flag
_cpu_thread_pool = cpu_host.thread_pool
CPU_SCHEDULER_FLAG = cpu_host.CPU_SCHEDULER_FLAG
THREADS_PER_DEVICE = cpu_host.THREADS_PER_DEVICE


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
        cpu_host.start_jax_quietly()
        print(version_text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxmem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    cpu_host.scheduler_flag()
    cpu_host.thread_pool()
    cpu_host.start_jax_quietly()  # no GPU here: the CUDA plugin's chatter is noise
    entry = _entry(name)
    from jaxmem.runtime.compat import UnsupportedVersion  # lazy: imports jax, after the CPU flags are set

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
