"""A multi-process run stops fast when a peer dies: each process beats in the coordination service's key-value
store every second and watches the others' beats from a daemon thread.

Why not leave it to jax: its coordination service notices a dead process only after heartbeat_timeout_seconds
(long by default), and the survivors then abort from C++ with a check-failure trace, after collectives have
hung on the dead peer. Here a peer whose beat has not moved for STALE_S seconds (or a coordinator that no
longer answers, when process 0 is the one that died) ends this process at once with one line naming the lost
process and the last saved step, exit code 76 (jaxmem.train.signals). jax.distributed's own heartbeat is set to
HEARTBEAT_S as a backstop (jaxmem.runtime.distributed).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from jaxmem.runtime.distributed import runtime_client
from jaxmem.train.run_lock import release_all
from jaxmem.runtime import distributed
from jaxmem.train.signals import EXIT_PEER_LOST
from jaxmem.runtime.stderr_guard import start

STALE_S = 10.0  # a peer silent this long is lost; well under the time a survivor may take to exit
PERIOD_S = 1.0
_PREFIX, _DONE = "jaxmem/alive/", "jaxmem/done/"


def last_saved_step(checkpoint_dir: str | Path) -> int | None:
    """The latest finalized step under a run's checkpoints/ (orbax renames a step's temporary folder to the
    bare step number when it is complete), read from the folder names alone."""
    try:
        steps = [int(p.name) for p in Path(checkpoint_dir).iterdir() if p.name.isdigit() and p.is_dir()]
    except OSError:
        return None
    return max(steps, default=None)


class PeerWatch:
    """Starts a daemon thread; `on_lost(process_id, why)` is called once, from that thread, when a peer is lost."""

    def __init__(self, client, me: int, count: int, on_lost: Callable[[int, str], None],
                 stale_s: float = STALE_S, period_s: float = PERIOD_S):
        self.client, self.me, self.count, self.on_lost = client, me, count, on_lost
        self.stale_s, self.period_s = stale_s, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxmem-peer-watch", daemon=True)

    def start(self) -> "PeerWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """This process is done with the run: peers stop watching it, and it stops watching them."""
        self._stop.set()
        try:
            self.client.key_value_set(f"{_DONE}{self.me}", "1", allow_overwrite=True)
        except Exception:
            pass

    def _loop(self) -> None:
        beat = 0
        now = time.monotonic()
        seen = {p: (None, now) for p in range(self.count) if p != self.me}  # last value, when it last changed
        failing_since = None
        while not self._stop.is_set():
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{_PREFIX}{self.me}", str(beat), allow_overwrite=True)
                values = {p: self._try_get(p) for p in seen}
                failing_since = None
            except Exception as e:  # the coordination service (on process 0) does not answer
                failing_since = failing_since or now
                if self.me != 0 and now - failing_since >= min(3.0, self.stale_s):
                    self._lost(0, f"the coordinator stopped answering ({str(e).splitlines()[0][:120]})")
                    return
                self._stop.wait(self.period_s)
                continue
            for p, value in list(values.items()):
                last, since = seen[p]
                if value is not None and value != last:
                    seen[p] = (value, now)
                elif now - since >= self.stale_s:
                    if self._left(p):
                        seen.pop(p)
                        continue
                    self._lost(p, f"no heartbeat for {now - since:.0f} s")
                    return
            self._stop.wait(self.period_s)

    def _left(self, process: int) -> bool:
        """Whether a silent peer finished the run and left; a service that does not answer says it did not."""
        try:
            return self._try_get(process, _DONE) is not None
        except Exception:
            return False

    def _try_get(self, process: int, prefix: str = _PREFIX) -> str | None:
        try:
            return self.client.key_value_try_get(f"{prefix}{process}")
        except Exception as e:  # NOT_FOUND before the peer's first beat; anything else is the service's
            if "NOT_FOUND" in str(e).upper().replace(" ", "_") or "not found" in str(e).lower():
                return None
            raise

    def _lost(self, process: int, why: str) -> None:
        if not self._stop.is_set():
            self.on_lost(process, why)


def exit_on_lost(checkpoint_dir: str | Path | None, code: int) -> Callable[[int, str], None]:
    """The on_lost that prints one line naming the lost process and the last saved step, then ends this
    process at once (os._exit: a collective waiting on the dead peer would never return)."""

    def on_lost(process: int, why: str) -> None:
        step = last_saved_step(checkpoint_dir) if checkpoint_dir else None
        saved = (f"the last saved checkpoint is step {step} in {checkpoint_dir}" if step is not None
                 else "no checkpoint was saved yet")
        sys.stderr.write(f"jaxmem train: lost process {process} ({why}); stopping this process; {saved}; "
                         "restart every process with the same command to resume\n")
        sys.stderr.flush()
        sys.stdout.flush()
        release_all()
        os._exit(code)

    return on_lost


_started: list[PeerWatch] = []  # the watch of the run this process is in
_guards: list = []  # the stderr helper of this process (jaxmem.runtime.stderr_guard), started once


def start_for_run(cfg) -> PeerWatch | None:
    """Starts the watch for a run of a multi-process group (once per process); None for one process."""
    index, count = distributed.process_group()
    client = runtime_client()
    if count == 1 or client is None:
        return None
    if _started:
        return _started[0]
    ckpt_dir = Path(cfg.out_dir).absolute() / "checkpoints" if cfg.checkpoint.enabled else None
    if not _guards:  # a lost coordinator aborts this process from C++: one line instead of the trace
        _guards.append(start(str(ckpt_dir) if ckpt_dir else None))
    watch = PeerWatch(client, index, count, exit_on_lost(ckpt_dir, EXIT_PEER_LOST)).start()
    _started.append(watch)
    return watch


def finish_run() -> None:
    """Called when this process leaves a run: its peers stop expecting its heartbeat."""
    while _started:
        _started.pop().stop()
