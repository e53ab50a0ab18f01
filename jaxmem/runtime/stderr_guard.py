"""Turns jax's abort on a lost coordinator into one line: a helper process between a multi-process run and its
stderr.

When process 0 of a multi-process run dies, the coordination service it hosted goes with it; jax's runtime
client in every survivor then aborts from C++ (LOG(FATAL): "Terminating process because the JAX distributed
service detected fatal errors", a check-failure stack trace, SIGABRT), faster than jaxmem.train.peer_watch can act and
with no Python hook (jax 0.10.2 cannot hand the error to a Python callback). So a multi-process run's fd 2 goes
through this helper (`start`). It passes every line through, holds back jax's coordination-service log lines
until it knows whether they end in that abort, and, if they do, swallows the trace and prints one line naming
the lost process and the last saved step. The run's exit status stays the abort's (134 / -6), documented in
docs/lifecycle.md.

Run as a script (`python stderr_guard.py CHECKPOINT_DIR`) so the helper imports neither jax nor jaxmem.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

_HELD = re.compile(r"^[WEF]\d{4} .*(coordination|preemption_sync|distributed)")
_FATAL = ("Terminating process because the JAX distributed service detected fatal errors",
          "*** Check failure stack trace", "terminate called after throwing")


def _last_saved(checkpoint_dir: str) -> int | None:
    try:
        return max((int(n) for n in os.listdir(checkpoint_dir) if n.isdigit()), default=None)
    except OSError:
        return None


_UNHEALTHY = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+?)\s*(?:The tasks|$)", re.S)


def _lost(seen: str, fatal: str) -> str:
    """Who was lost, read from jax's messages: the tasks its coordination service found silent (this process
    hosts the service and its heartbeat backstop fired), else process 0 when the service itself is gone."""
    silent = _UNHEALTHY.search(seen)
    if silent:
        tasks = ", ".join(t for t in re.split(r"[,\s]+", silent.group(1)) if t)
        return f"process {tasks} (no heartbeat reached jax's coordination service)"
    if "leader" in fatal or "coordination service" in fatal:
        return "process 0 (the coordinator: its service stopped answering)"
    return "another process"


def _line(checkpoint_dir: str, who: str) -> str:
    step = _last_saved(checkpoint_dir) if checkpoint_dir else None
    saved = (f"the last saved checkpoint is step {step} in {checkpoint_dir}" if step is not None
             else "no checkpoint was saved yet")
    return (f"jaxmem train: lost {who}; jax stopped this process; {saved}; restart every process with the same "
            "command to resume\n")


def filter_stream(source, sink, checkpoint_dir: str) -> None:
    """Copies `source` lines to `sink` until EOF, replacing jax's fatal coordination error by one line."""
    held: list[str] = []
    fatal = ""
    recent: list[str] = []  # the last lines, passed through or not: jax names the silent task before it aborts
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", "replace")
        if fatal:
            fatal += line
            continue
        recent = (recent + [line])[-40:]
        if any(marker in line for marker in _FATAL):
            fatal = "".join(held) + line
            continue
        if _HELD.match(line):
            held.append(line)
            continue
        if held and not line.startswith((" ", "Additional GRPC", ":UNKNOWN")):
            sink.write("".join(held))
            held = []
        if held:
            held.append(line)  # a continuation of a held log line
            continue
        sink.write(line)
        sink.flush()
    sink.write(_line(checkpoint_dir, _lost("".join(recent) + fatal[:4000], fatal)) if fatal else "".join(held))
    sink.flush()


def start(checkpoint_dir: str | None) -> subprocess.Popen | None:
    """Routes this process's fd 2 through the helper; returns it (None where it cannot start)."""
    try:
        original = os.dup(2)
        helper = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), checkpoint_dir or ""],
                                  stdin=subprocess.PIPE, stdout=original, stderr=original, close_fds=True)
    except OSError:
        return None
    sys.stderr.flush()
    os.dup2(helper.stdin.fileno(), 2)
    os.close(original)
    return helper


if __name__ == "__main__":
    out = open(sys.stdout.fileno(), "w", encoding="utf-8", errors="replace", closefd=False)
    filter_stream(sys.stdin.buffer, out, sys.argv[1] if len(sys.argv) > 1 else "")
