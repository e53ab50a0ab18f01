"""The rich Console every command prints through: a terminal's width on a terminal; elsewhere (a pipe, a file, a
log collector) wide enough that nothing wraps, so each printed line stays one line and tables keep their
natural width."""
from __future__ import annotations

import sys

WIDE = 1000  # columns of a console that is not a terminal: more than any line or table jaxmem prints


def is_terminal(file=None) -> bool:
    file = file or sys.stdout
    return bool(getattr(file, "isatty", lambda: False)())


def make_console(file=None, **kwargs):
    """A rich Console on `file` (default: stdout, looked up when printing, as rich does)."""
    from rich.console import Console

    if is_terminal(file):
        return Console(file=file, **kwargs)
    return Console(file=file, width=WIDE, soft_wrap=True, **kwargs)
