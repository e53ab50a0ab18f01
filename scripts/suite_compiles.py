"""Where the suite's compile time goes, from a profiling run of the tests:

    JAXMEM_PROFILE_COMPILES=/tmp/compiles.jsonl make test    # tests/conftest.py logs every backend compile
    python scripts/suite_compiles.py /tmp/compiles.jsonl     # per file, per platform, and the repeats

A repeat is the same lowered module compiled again in the run: a deviceless GPU executable (jax's persistent
cache cannot hold those; share them through a fixture or jaxmem.plan.figure_cache) or a CPU compile under the
cache's 0.2 s threshold. Seconds are wall time measured on this machine's CPU, with both xdist workers busy."""
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path


def main(argv: list[str]) -> int:
    lines = [json.loads(line) for line in Path(argv[1]).read_text().splitlines() if line.strip()]
    rows = [r for r in lines if "kind" not in r]
    reads = [r for r in lines if r.get("kind") == "cache_read"]
    writes = [r for r in lines if r.get("kind") == "cache_write"]
    hits = [r for r in reads if r["hit"]]
    print(f"persistent cache: {len(hits)} hits of {len(reads)} reads ({sum(r['seconds'] for r in reads):.0f} s "
          f"reading), {len(writes)} writes ({sum(r['seconds'] for r in writes):.0f} s)")
    per_file: dict[str, Counter] = defaultdict(Counter)
    by_key: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        file = row["test"].split("::")[0].rsplit("/", 1)[-1] or "(outside a test)"
        per_file[file]["cpu" if row["platform"] == "cpu" else "gpu"] += row["seconds"]
        per_file[file]["count"] += 1
        by_key[row["key"]].append(row)
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} compiles, {total:.0f} s (measured on CPU)")
    print(f"{'file':40s} {'compiles':>8s} {'cpu s':>8s} {'gpu s':>8s}")
    ranked = sorted(per_file.items(), key=lambda kv: -(kv[1]["cpu"] + kv[1]["gpu"]))
    for file, c in ranked[:25]:
        print(f"{file:40s} {c['count']:8d} {c['cpu']:8.1f} {c['gpu']:8.1f}")
    repeats = sorted(((sum(r["seconds"] for r in rs[1:]), rs) for rs in by_key.values() if len(rs) > 1),
                     key=lambda x: -x[0])
    print(f"\nrepeated compiles: {sum(s for s, _ in repeats):.0f} s in {sum(len(rs) - 1 for _, rs in repeats)}")
    for seconds, rs in repeats[:15]:
        tests = sorted({r["test"].rsplit("/", 1)[-1] for r in rs})
        print(f"  {seconds:6.1f} s  x{len(rs)}  {rs[0]['platform']} {rs[0]['module'][:30]}  {'; '.join(tests)[:150]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
