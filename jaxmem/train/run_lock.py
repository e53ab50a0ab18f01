"""One run per out_dir: `<out_dir>/.jaxmem.lock` names the run that owns the folder.

The lock file holds the owner's host, pid and start time (JSON). It is created with O_CREAT|O_EXCL before the
run writes anything into out_dir, so of two runs started on one folder exactly one gets it; the other is
refused in one line naming the owner. A lock whose pid is dead on this host (a run killed with -9, a crashed
machine's leftover after a reboot) is taken over with a warning. A lock from another host is never taken
over: its pid cannot be checked from here, so the message says to delete the file if that run is gone.
A multi-process run takes one lock, on process 0 (the train loop shares the outcome with the others).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

from jaxmem.config.schema import ConfigError
from jaxmem.train.run_folder import check_out_dir
from jaxmem.runtime import distributed

LOCK_NAME = ".jaxmem.lock"
_held: dict[Path, "RunLock"] = {}  # out_dir -> the lock this process holds (a nested `hold` is a no-op)
_owned: set[Path] = set()  # out_dirs inside an `owned` block of this process (any process of a group)


class RunLockError(RuntimeError):
    """out_dir belongs to another live run; the message is one line naming it."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _owner_text(owner: dict) -> str:
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')} (started {when})"


def read_owner(out_dir: str | Path) -> dict | None:
    """The lock's content, or None when there is no lock; {} for a lock file that cannot be read as JSON."""
    path = Path(out_dir) / LOCK_NAME
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class RunLock:
    """The lock of one out_dir; `acquire` raises RunLockError if another live run holds it."""

    def __init__(self, out_dir: str | Path):
        self.out_dir = Path(out_dir).absolute()
        self.path = self.out_dir / LOCK_NAME
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self.created = False

    def acquire(self) -> None:
        self.created = not self.out_dir.exists()  # removed again on release if the run wrote nothing
        for _ in range(3):  # a takeover races with another starter at most a couple of times
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as e:  # read-only mount, a file in the way, /proc: one line, not a traceback
                raise ConfigError(f"out_dir: {self.out_dir} cannot be written ({e.strerror or e})") from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self.me) + "\n")
            return
        raise RunLockError(f"out_dir {self.out_dir}: could not take {self.path} (other runs keep starting on it)")

    def _take_over_if_stale(self) -> None:
        owner = read_owner(self.out_dir)
        if owner is None:
            return  # released meanwhile: try again
        same_host = owner.get("host") == self.me["host"]
        pid = owner.get("pid")
        if not owner or (same_host and isinstance(pid, int) and not _alive(pid)):
            what = f"{_owner_text(owner)} is no longer running" if owner else "it is unreadable"
            print(f"jaxmem: warning: taking over the lock {self.path}: {what}", file=sys.stderr)
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            return
        gone = ("" if same_host else f"; if that run is gone, delete {self.path}")
        raise RunLockError(f"out_dir {self.out_dir} is in use by another run: {_owner_text(owner)}; wait for it, "
                           f"stop it (Ctrl-C saves a checkpoint), or use another out_dir{gone}")

    def release(self) -> None:
        """Removes the lock if it is still ours, and out_dir too if this lock made it and the run wrote nothing
        (bad input fails a run before anything is written)."""
        owner = read_owner(self.out_dir)
        if owner and owner.get("pid") == self.me["pid"] and owner.get("host") == self.me["host"]:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            if self.created:
                try:
                    self.out_dir.rmdir()  # only when empty
                except OSError:
                    pass


def release_all() -> None:
    """Releases every lock this process holds; for exits that skip `finally` blocks (os._exit)."""
    for key, lock in list(_held.items()):
        _held.pop(key, None)
        lock.release()


class hold:
    """Context manager: holds the out_dir's lock for the block (no-op when this process holds it already)."""

    def __init__(self, out_dir: str | Path, enabled: bool = True):
        self.key = Path(out_dir).absolute()
        self.lock = None if (not enabled or self.key in _held) else RunLock(self.key)

    def __enter__(self):
        if self.lock is not None:
            self.lock.acquire()
            _held[self.key] = self.lock
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            _held.pop(self.key, None)
            self.lock.release()
        return False


@contextlib.contextmanager
def owned(out_dir: str | Path, config_path: str | Path | None = None):
    """Holds out_dir's lock for the block: on process 0 of a multi-process run (the others learn whether it
    was refused and raise the same RunLockError or ConfigError), on the one process otherwise. First, out_dir
    must be free for a run (jaxmem.train.run_folder.check_out_dir; `config_path`: the run's config file)."""
    key = Path(out_dir).absolute()
    if key in _owned:  # `jaxmem train` takes it before `run`, which takes it again for library callers
        yield
        return
    index, _ = distributed.process_group()
    guard = hold(key, enabled=index == 0)

    def claim():
        check_out_dir(key, config_path)
        guard.__enter__()

    distributed.decided_on_lead(f"lock:{key}", claim, RunLockError, ConfigError)
    _owned.add(key)
    try:
        yield
    finally:
        _owned.discard(key)
        guard.__exit__(None, None, None)
