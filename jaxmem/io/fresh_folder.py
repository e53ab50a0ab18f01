"""Exports land whole or not at all: written into a hidden folder beside the target, then renamed into place.

A folder that already holds files is refused unless the caller allows replacing it, and then it is replaced
whole, so two exports never mix (one's single file beside the other's shards) and a user's own files there
are never written over one by one.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from jaxmem.config.schema import ConfigError


def check_target(out: str | Path, *, overwrite: bool, key: str = "--out") -> Path:
    """`out` as a Path if an export may go there; a one-line ConfigError naming `key` otherwise."""
    out = Path(out)
    if not str(out).strip():
        raise ConfigError(f"{key}: empty; name the folder to write")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: {out} is a file; name a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"{key}: {out} is not empty; name a new folder, or pass --overwrite to replace it whole")
    return out


@contextlib.contextmanager
def written_whole(out: str | Path, *, overwrite: bool, key: str = "--out"):
    """Yields a fresh folder beside `out` to write into; on success it becomes `out` (an old `out` is removed
    only after the new one is complete), on failure it is deleted and `out` is left as it was."""
    out = check_target(out, overwrite=overwrite, key=key).absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise ConfigError(f"{key}: cannot write beside {out} ({e.strerror or e})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the export is a normal folder
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.rename(out, retired / out.name)
        os.rename(staging, out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, out)
