"""The rich Console every command prints through: a terminal's width on a terminal; elsewhere (a pipe, a file, a
log collector) wide enough that nothing wraps, so each printed line stays one line and tables keep their
natural width. A report meant to be read, not parsed (explain's), wraps instead: make_wrapping_console."""
from __future__ import annotations

import os
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


READABLE = 160  # columns of a report meant to be read rather than parsed (explain's) outside a terminal


def make_wrapping_console(file=None):
    """A Console whose long lines and table cells wrap: at the terminal's width on a terminal, else at
    $COLUMNS or READABLE columns, so a pipe or a log gets lines a person can read (explain's table and advice
    run to several hundred characters unwrapped)."""
    from rich.console import Console

    if is_terminal(file):
        return Console(file=file)
    try:
        width = int(os.environ.get("COLUMNS", "")) or READABLE
    except ValueError:
        width = READABLE
    return Console(file=file, width=max(width, 40))
