"""No measurements in the code's narrative: comments and docstrings under jaxmem/ carry no figure with a unit
(GiB, ms, s, tok/s, ...), no speed-up (1.9x), no percentage, no date and no GPU model name (H100, RTX 4090, ...).
Those go to benchmarks/ or docs/ (STYLE.md, "Figures live in benchmarks/"); a comment links there.

Text in backticks or double quotes is a literal (a message XLA prints, a format), not narrative, and is left
out; identifiers such as the target name h100-80g are lowercase and not matched. Byte counts per element
("4 bytes") and shape products ("8 x h100-80g", "3.5 x fwd") are definitions, not measurements.
"""
import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "jaxmem"

_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?"
PATTERNS = {
    "a figure with a unit": re.compile(
        _NUMBER + r"\s?(?:[KMGT]i?B|ms|us|µs|ns|s|sec|seconds?|minutes?|hours?|TFLOP/s|TFLOPS|GB/s|tok/s|"
                  r"tokens/s)(?![\w/])"),
    "a speed-up": re.compile(_NUMBER + r"(?:x(?![\w])|\s?x (?:faster|slower|speed-?up|quicker|less|more|smaller|"
                                       r"larger|fewer)\b)"),
    "a percentage": re.compile(_NUMBER + r"\s?%"),
    "a date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-\d\d)?\b|\b(?:January|February|March|April|May|"
                         r"June|July|August|September|October|November|December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|"
                         r"Sept|Oct|Nov|Dec)\.? (?:\d{1,2}, )?(?:19|20)\d\d\b"),
    "a GPU model": re.compile(r"\b(?:[HB]\d{2,3}|A100|A10G?|A30|A40|A6000|V100|T4|L4|L40S?|GH200|GB200|"
                              r"MI\d{3}X?|RTX ?\d{4}(?: Ti)?)\b"),
}
_LITERAL = re.compile(r"`[^`]{0,300}`|\"[^\"\n]*\"")  # a backticked message may wrap onto a second line


def narrative(source: str):
    """(line, text) of every comment and docstring of a module's source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node.body[0].lineno, doc


def figures(text: str) -> list[tuple[str, str]]:
    """(kind, match) of every measurement in a piece of narrative, its literals left out."""
    prose = _LITERAL.sub(" ", text)
    return [(kind, m.group(0)) for kind, pattern in PATTERNS.items() for m in pattern.finditer(prose)]


def test_the_patterns_catch_measurements_and_leave_definitions_alone():
    caught = ["the step took 12.5 GiB", "8.02GiB", "fwd+bwd 3.41 ms vs 13.32", "1.67 s, measured 1.86 s",
              "1.9x faster", "23x", "2 x faster than blocked", "30-40% less", "~45%", "measured 2026-11-22",
              "in Nov 2026", "on an H100", "one H200's host", "an RTX 4090", "RTX4090", "A100", "L40S",
              "989 TFLOP/s", "~92 GB over the link", "75,231 tok/s", "62 MB", "100 seconds"]
    for text in caught:
        assert figures(text), text
    kinds = {kind for text in caught for kind, _ in figures(text)}
    assert kinds == set(PATTERNS)  # every pattern is exercised
    left = ["[B, T, D] activations", "the h100-80g target", "8 x h100-80g", "4 bytes per element",
            "fwd + bwd = 3.5 x fwd", "`Out of memory while trying to allocate 8.02GiB`",
            '"RESOURCE_EXHAUSTED: 70.00GiB"', "x_t = 3", "sm_89", "layer 32", "float32", "a 2-layer step",
            "(`1.23 s`, `45.6 ms`)", "Qwen3-30B-A3B", "llama3-8b", "the 0.11 series", "version 0.12.0.1",
            "top-k of 8 experts", "B=1 T=8192", "H=128 heads"]
    for text in left:
        assert not figures(text), (text, figures(text))


def test_the_scanner_reads_comments_and_docstrings_only():
    source = ('"""Module: took 3.2 GiB on an H100."""\n'
              "X = '9.9 GiB in code is data'  # measured 4.1 ms\n"
              "def f():\n"
              "    '''Ran 2x faster.'''\n"
              "    return \"5 GiB\"\n")
    found = [(line, kind) for line, text in narrative(source) for kind, _ in figures(text)]
    assert sorted(found) == [(1, "a GPU model"), (1, "a figure with a unit"), (2, "a figure with a unit"),
                             (4, "a speed-up")]


def test_no_measurements_in_the_code_narrative():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in narrative(path.read_text()):
            for kind, match in figures(text):
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {kind}: {match!r}")
    assert len(list(PACKAGE.rglob("*.py"))) > 100  # the package was found and read
    assert not problems, ("measurements in comments or docstrings; move them to benchmarks/ or docs/ and link "
                          "there (benchmarks/constants.md):\n" + "\n".join(problems))
