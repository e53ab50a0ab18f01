"""The code blocks of the docs as the tests read them, so a page's commands and snippets cannot go stale.

Conventions of README.md and docs/*.md (checked by tests/integration/test_doc_commands.py):
- every fenced block names its language: `bash` (commands a user types), `python` (code a user runs), `yaml` (a
  config, or a fragment of one), `text` (output, formulas, command synopses, file formats: never run);
- a `yaml` block whose first line is `# NAME.yaml` is a file the page asks the user to save under that name;
- a `bash` or `python` block whose first line starts with `# GPU only` needs a GPU: the tests skip it and say so;
  so does a single command whose own comment starts with `# GPU only`;
- a `bash` line whose comment mentions `Ctrl-C`, followed by the same command, is a run the user interrupts and
  resumes (the tests send SIGINT, then check the rerun resumes).
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_ONLY = "# GPU only"
LANGUAGES = ("bash", "python", "yaml", "text")
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclasses.dataclass(frozen=True)
class Command:
    """One command line of a bash block (continuation lines joined): its words and its trailing comment."""
    page: str
    line: int
    argv: tuple[str, ...]
    comment: str

    @property
    def gpu_only(self) -> bool:
        return self.comment.startswith(GPU_ONLY[2:])

    @property
    def interrupted(self) -> bool:
        return "Ctrl-C" in self.comment

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    @property
    def gpu_only(self) -> bool:
        return self.lang in ("bash", "python") and self.first_line.startswith(GPU_ONLY)

    @property
    def filename(self) -> str | None:
        """`NAME.yaml` for a yaml block that opens with `# NAME.yaml`: the file the page asks the user to save."""
        m = re.fullmatch(r"#\s*([\w./-]+\.ya?ml)\b.*", self.first_line)
        return m.group(1) if self.lang == "yaml" and m else None

    def commands(self) -> list[Command]:
        """The block's command lines (bash only): comments kept apart, `\\` continuations joined."""
        assert self.lang == "bash", self
        out, pending, start = [], "", 0
        for i, raw in enumerate(self.text.splitlines()):
            if not pending:
                start = i
            pending += raw
            if raw.rstrip().endswith("\\"):
                pending = pending.rstrip()[:-1] + " "
                continue
            code, comment = _split_comment(pending)
            pending = ""
            if code.strip():
                out.append(Command(self.page, self.line + 1 + start, tuple(shlex.split(code)), comment))
        return out

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.lang})"


def _split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of a shell line: the comment is what follows the first unquoted ` #`."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i], line[i + 1:].strip()
    return line, ""


def blocks(page: str | Path) -> list[Block]:
    """Every fenced block of a page, in order."""
    path = Path(page)
    path = path if path.is_absolute() else REPO / path
    text = path.read_text()
    rel = str(path.relative_to(REPO))
    return [Block(rel, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(text)]


def pages() -> list[str]:
    """The pages whose blocks the tests read: README.md and every page under docs/."""
    return ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def inline_commands(page: str) -> list[tuple[int, str]]:
    """(line, text) of every inline code span of the page's prose that starts with `jaxmem ` (blocks left out)."""
    text = (REPO / page).read_text()
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"`(jaxmem [^`\n]+)`", prose)]


def section(page_blocks: list[Block], page: str, heading: str) -> list[Block]:
    """The blocks under the page's heading `heading` (up to the next heading of the same or a higher level)."""
    text = (REPO / page).read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.lstrip("#").strip() == heading and line.startswith("#"))
    level = len(text[start]) - len(text[start].lstrip("#"))
    end = next((i for i in range(start + 1, len(text))
                if text[i].startswith("#") and len(text[i]) - len(text[i].lstrip("#")) <= level
                and not _inside_block(page_blocks, i + 1)), len(text))
    return [b for b in page_blocks if start < b.line - 1 < end]


def _inside_block(page_blocks: list[Block], line: int) -> bool:
    return any(b.line < line <= b.line + b.text.count("\n") + 1 for b in page_blocks)
