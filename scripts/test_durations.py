"""tests/durations.json from a recorded run: each test file's seconds (setup + call + teardown of its tests,
summed) and each test's own when it took at least MIN_SECONDS.

    JAXMEM_RECORD_DURATIONS=/tmp/durations.jsonl make test     # or any pytest run of the suite
    python scripts/test_durations.py /tmp/durations.jsonl      # writes tests/durations.json, prints the top

tests/conftest.py starts the slowest work first by it (measured on this machine's CPU; only the order is
used, never a time limit). Keys are file names and `file::test` (no folder), so moving a file between
tests/unit and tests/integration keeps its record."""
import json
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
MIN_SECONDS = 2.0


def main(argv: list[str]) -> int:
    files: dict[str, float] = defaultdict(float)
    tests: dict[str, float] = defaultdict(float)
    seen = set()
    for line in Path(argv[1]).read_text().splitlines():
        row = json.loads(line)
        if (row["test"], row["when"]) in seen:  # recorded twice (xdist worker and controller, before the fix)
            continue
        seen.add((row["test"], row["when"]))
        path, _, name = row["test"].partition("::")
        file = path.rsplit("/", 1)[-1]
        files[file] += row["seconds"]
        tests[f"{file}::{name}"] += row["seconds"]
    ranked = lambda d: dict(sorted(((k, round(v, 1)) for k, v in d.items()), key=lambda kv: -kv[1]))  # noqa: E731
    record = {"files": ranked(files), "tests": {k: v for k, v in ranked(tests).items() if v >= MIN_SECONDS}}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {OUT}: {len(files)} files, {len(record['tests'])} tests of {MIN_SECONDS:g} s or more, "
          f"{sum(files.values()):.0f} s in all (measured on CPU)")
    for name, seconds in list(record["files"].items())[:15]:
        print(f"  {seconds:7.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
