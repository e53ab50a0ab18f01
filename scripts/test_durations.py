"""tests/durations.json from a recorded run: each test file's seconds (setup + call + teardown of its tests).

    JAXMEM_RECORD_DURATIONS=/tmp/durations.jsonl make test     # or any pytest run of the suite
    python scripts/test_durations.py /tmp/durations.jsonl      # writes tests/durations.json, prints the top

tests/conftest.py orders the files by it, slowest first (measured on this machine's CPU; only the order is
used, never a time limit)."""
import json
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def main(argv: list[str]) -> int:
    per_file: dict[str, float] = defaultdict(float)
    for line in Path(argv[1]).read_text().splitlines():
        row = json.loads(line)
        per_file[row["test"].split("::")[0].rsplit("/", 1)[-1]] += row["seconds"]
    ranked = dict(sorted(((k, round(v, 1)) for k, v in per_file.items()), key=lambda kv: -kv[1]))
    OUT.write_text(json.dumps(ranked, indent=1) + "\n")
    print(f"wrote {OUT}: {len(ranked)} files, {sum(ranked.values()):.0f} s in all (measured on CPU)")
    for name, seconds in list(ranked.items())[:15]:
        print(f"  {seconds:7.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
