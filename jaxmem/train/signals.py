"""SIGTERM and Ctrl-C during `jaxmem train`: finish the step, save, say so, exit with a documented code.

Exit codes of `jaxmem train` (docs/lifecycle.md):
  0   trained to train.steps
  1   stopped by a problem the message names (NaN loss, out of memory)
  2   bad config or input (one line naming the key or file)
  3   out_dir is in use by another live run (the lock, jaxmem.train.run_lock)
  75  stopped by SIGTERM or a first Ctrl-C after saving a checkpoint of the current step: rerun to resume
  76  another process of a multi-process run died or hung: this one stopped (the last saved step is named)
  134 process 0 of a multi-process run died: jax aborts the others (SIGABRT); jaxmem.runtime.stderr_guard prints the line
  130 a second Ctrl-C: stopped at once, without saving

One process: Python handlers set a flag the train loop reads after each step. Several processes: the step to
save on must be the same everywhere, so SIGTERM goes to jax's preemption sync manager (installed by
jax.distributed.initialize; a notice on any process reaches all of them and they agree on the next step,
`multihost_utils.reached_preemption_sync_point`), and a first Ctrl-C is turned into a SIGTERM to this process.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from jaxmem.train.run_lock import release_all

EXIT_DONE, EXIT_ERROR, EXIT_CONFIG, EXIT_LOCKED = 0, 1, 2, 3
EXIT_SAVED, EXIT_PEER_LOST, EXIT_ABORTED = 75, 76, 130


class StopRequest:
    """Installs the handlers for a block (main thread only; elsewhere it does nothing) and says when to stop.

    `multi_process`: SIGTERM is left to jax's preemption notifier and `due(step)` asks the sync manager.
    """

    def __init__(self, multi_process: bool = False):
        self.multi = multi_process
        self.signal: str | None = None  # the name of the first signal received
        self._saved: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self
        wanted = [signal.SIGINT] if self.multi else [signal.SIGINT, signal.SIGTERM]
        for sig in wanted:
            self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()
        return False

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: the user does not want to wait for the save
                sys.stderr.write("\njaxmem train: second Ctrl-C: stopped at once, nothing saved since the last "
                                 "checkpoint\n")
                sys.stderr.flush()
                release_all()
                os._exit(EXIT_ABORTED)
            return  # a repeated SIGTERM: the save is under way
        self.signal = name
        sys.stderr.write(f"\njaxmem train: {name} received: finishing the current step, then saving a checkpoint "
                         "(Ctrl-C again stops at once without saving)\n")
        sys.stderr.flush()
        if self.multi and signum == signal.SIGINT:
            os.kill(os.getpid(), signal.SIGTERM)  # jax's notifier tells every process; they agree on a step

    def due(self, step: int) -> bool:
        """Whether to save `step` and stop: called after every step, on every process."""
        if not self.multi:
            return self.signal is not None
        from jax.experimental import multihost_utils

        try:
            reached = multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # jax_enable_preemption_service is off: no agreement possible, SIGTERM kills
            self.multi = False
            return self.signal is not None
        if reached:
            self.signal = self.signal or "SIGTERM"
        return reached


def exit_now(line: str, code: int = EXIT_ERROR) -> None:
    """Prints `line` on stderr and ends the process at once with `code`, the run's lock released: for a failed
    checkpoint save, whose orbax threads would otherwise hold the interpreter's exit for minutes (they wait on
    the failed save's barriers) and print tracebacks of its coroutines on the way out."""
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    release_all()
    os._exit(code)
