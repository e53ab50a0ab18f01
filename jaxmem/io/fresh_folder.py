"""Exports land whole or not at all: written into a hidden folder beside the target, then renamed into place.

A folder that already holds files is refused unless the caller allows replacing it, and then it is replaced
whole, so two exports never mix (one's single file beside the other's shards) and a user's own files there
are never written over one by one. A folder that holds a training run (its checkpoints, metrics or resolved config),
lies inside one, or holds one further down is never written into nor replaced, `overwrite` or not. A hidden
folder an export killed midway left beside the target (its process gone) is removed by the next export there.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from glob import escape as glob_escape
from pathlib import Path

from jaxmem.config.schema import ConfigError

# What marks a folder as a training run's (jaxmem.train.run_folder writes these; floor 5 cannot import it).
RUN_MARKERS = ("checkpoints", "config.resolved.yaml", "metrics.jsonl", ".jaxmem.lock")
_STAGING, _RETIRED = "partial", "old"  # suffixes of the hidden folders beside the target


def _a_run(folder: Path) -> bool:
    """Whether `folder` holds any of a run's outputs (replacing it would delete them)."""
    return any((folder / name).exists() or (folder / name).is_symlink() for name in RUN_MARKERS)


def _surely_a_run(folder: Path) -> bool:
    """Whether `folder` is a run's own (an enclosing folder merely named with a `checkpoints` inside is not)."""
    names = {name for name in RUN_MARKERS if (folder / name).exists()}
    return bool(names & {"config.resolved.yaml", ".jaxmem.lock"}) or names >= {"checkpoints", "metrics.jsonl"}


def _run_at_or_above(out: Path) -> Path | None:
    """The run folder that `out` is, or lies inside (links resolved), else None."""
    if out.is_dir() and _a_run(out):
        return out
    return next((folder for folder in out.parents if _surely_a_run(folder)), None)


def _run_below(out: Path) -> Path | None:
    """A run folder somewhere inside `out` (links not followed), else None."""
    for root, dirs, _ in os.walk(out):
        if _a_run(Path(root)):
            return Path(root)
    return None


def refuse_runs(out: Path, key: str, overwrite: bool = False) -> None:
    """A one-line ConfigError naming `key` when `out` is a run's folder or lies inside one, or (`overwrite`: it
    is to be replaced) holds one further down."""
    resolved = out.resolve()
    run = _run_at_or_above(resolved)
    if run is not None:
        where = "is" if run == resolved else "lies inside"
        raise ConfigError(f"{key}: {out} {where} the training run {run} (it holds "
                          f"{', '.join(n for n in RUN_MARKERS if (run / n).exists())}); nothing but that run writes "
                          "into its folder: name a folder outside it")
    run = _run_below(resolved) if overwrite and resolved.is_dir() else None  # replacing it would delete the run
    if run is not None:
        raise ConfigError(f"{key}: {out} holds the training run {run}; replacing it would delete that run: name "
                          "another folder")


def check_target(out: str | Path, *, overwrite: bool, key: str = "--out") -> Path:
    """`out` as a Path if an export may go there; a one-line ConfigError naming `key` otherwise."""
    out = Path(out)
    if not str(out).strip():
        raise ConfigError(f"{key}: empty; name the folder to write")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}: {out} is a file; name a folder")
    refuse_runs(out, key, overwrite)
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
        _remove_stale(out)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=f".{os.getpid()}.{_STAGING}",
                                        dir=out.parent))
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
        retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=f".{os.getpid()}.{_RETIRED}",
                                        dir=out.parent))
        os.rename(out, retired / out.name)
        os.rename(staging, out)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.rename(staging, out)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's live process
        return False
    return False


def _remove_stale(out: Path) -> None:
    """Removes the hidden folders an export to `out` left when it was killed (`.NAME.XXXX.PID.partial` with its
    half-written files, `.NAME.XXXX.PID.old` with a replaced export) once their process is gone; another live
    export's are left alone."""
    for entry in out.parent.glob(f".{glob_escape(out.name)}.*.*"):
        parts = entry.name.rsplit(".", 2)
        if (len(parts) == 3 and parts[2] in (_STAGING, _RETIRED) and parts[1].isdigit() and entry.is_dir()
                and not entry.is_symlink() and _gone(int(parts[1]))):
            shutil.rmtree(entry, ignore_errors=True)
