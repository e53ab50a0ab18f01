"""`jaxmem` command line: each subcommand lives in its own module's `main(argv)`."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("jaxmem.train", "run a config-driven training run"),
    "plan": ("jaxmem.plan.cli", "per-device memory bill for a target GPU (deviceless compile)"),
    "explain": ("jaxmem.explain", "which source lines own the biggest buffers at the peak"),
    "sweep": ("jaxmem.sweep", "plan the cross product of config overrides"),
    "import-hf": ("jaxmem.hf", "convert a Hugging Face checkpoint into an orbax params checkpoint"),
}


def _usage() -> str:
    lines = ["usage: jaxmem COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxmem: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    from jaxmem.config import ConfigError

    try:
        return module.main(rest) or 0
    except ConfigError as e:
        print(f"jaxmem {name}: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
