"""The help text every command shares: the description's paragraphs wrapped to the terminal, examples kept."""
from __future__ import annotations

import argparse
import textwrap


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: the description's paragraphs wrapped to the terminal, the epilog (examples, whose
    lines are indented) kept as written."""

    def _fill_text(self, text, width, indent):
        if any(line.startswith(" ") for line in text.splitlines()):
            return super()._fill_text(text, width, indent)
        return "\n\n".join(textwrap.fill(" ".join(p.split()), width, initial_indent=indent, subsequent_indent=indent)
                           for p in text.split("\n\n"))
