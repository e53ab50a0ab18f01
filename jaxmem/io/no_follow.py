"""Files a run writes into its out_dir are opened without following a symbolic link.

A link planted at `out_dir/config.resolved.yaml` (or metrics.jsonl, a memory profile, a report) would otherwise
have the run write over whatever file it points to. Opened with O_NOFOLLOW, such a path is a one-line
ConfigError naming it, and nothing is written.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from jaxmem.config.schema import ConfigError

_MODES = {"w": os.O_TRUNC, "a": os.O_APPEND}


def link_refused(path: str | Path) -> ConfigError:
    return ConfigError(f"{path} is a symbolic link; jaxmem never writes through a link (it would overwrite the "
                       "file it points to): remove the link, or use a new out_dir")


def open_no_follow(path: str | Path, mode: str = "w", *, binary: bool = False):
    """`path` opened for writing ("w": truncated, "a": appended to; created if missing) without following a
    link at its last component; a link there is a one-line ConfigError."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | _MODES[mode]
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or Path(path).is_symlink():
            raise link_refused(path) from None
        raise
    return os.fdopen(fd, mode + ("b" if binary else ""))


def write_text(path: str | Path, text: str) -> None:
    with open_no_follow(path, "w") as f:
        f.write(text)


def write_bytes(path: str | Path, data: bytes) -> None:
    with open_no_follow(path, "w", binary=True) as f:
        f.write(data)
