"""Writes the example of docs/tune.md: `jaxmem tune` on the Llama-3-8B recipe for 8 x H100, run cold (a fresh plan
cache in a temporary folder), its output placed between the page's markers. tests/integration/test_tune_example.py
checks that the page holds what this prints and that the winner fits.

Usage: python scripts/tune_example.py [--check]   (--check: exit 1 if docs/tune.md differs, write nothing)
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tune.md"
CONFIG = "configs/llama3-8b-8xh100.yaml"
ARGS = ["--target", "h100-80g", "--gpus-per-host", "8", "--global-batch", "32"]
BEGIN = "<!-- tune-example: written by scripts/tune_example.py; do not edit -->"
END = "<!-- /tune-example -->"


def run(workers: int = 2) -> tuple[str, dict]:
    """(the example's block, tune's --json result), from a cold run in a temporary folder."""
    from jaxmem import cli  # lazy: the CLI sets up jax for this host first

    with tempfile.TemporaryDirectory(prefix="jaxmem-tune-example-") as tmp:
        here = os.getcwd()
        out = io.StringIO()
        try:
            os.chdir(tmp)
            with contextlib.redirect_stdout(out):
                code = cli.main(["tune", str(ROOT / CONFIG), *ARGS, "--json", "tune.json", "--out", "tuned.yaml",
                                 "--workers", str(workers)])
            result = json.loads(Path("tune.json").read_text())
        finally:
            os.chdir(here)
    if code != 0:
        raise SystemExit(f"tune_example: jaxmem tune exited {code}:\n{out.getvalue()}")
    command = " ".join(["jaxmem tune", CONFIG, *ARGS])
    return "\n".join([BEGIN, "```text", f"$ {command}", out.getvalue().rstrip(), "```", END]), result


def current(text: str) -> str:
    """The block between the markers of the page's text ('' where there is none)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]


def main(argv: list[str]) -> int:
    block, _ = run()
    text = DOC.read_text()
    if "--check" in argv:
        return 0 if current(text) == block else 1
    if not current(text):
        raise SystemExit(f"tune_example: {DOC} has no {BEGIN} ... {END} block")
    DOC.write_text(text.replace(current(text), block))
    print(f"wrote the example into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
