#!/usr/bin/env python3
"""Is the lowered train step byte-identical between two checkouts of jaxmem (issue #29's check)?

    python lowered_check.py BEFORE_REPO AFTER_REPO     # dumps both, compares, exit 0 when identical
    python lowered_check.py --dump REPO OUT_DIR        # writes OUT_DIR/<case>.mlir for one checkout

Each case is lowered in a fresh process whose PYTHONPATH is the checkout (its own jaxmem), on 8 virtual CPU
devices, through the public API only (`jaxmem.load_config`, `jaxmem.build_program`, `TrainProgram.lower`),
which both layouts keep: `jax.jit(step).lower(abstract state, abstract batch).as_text()` (StableHLO, no
source locations). Cases: the default tiny config; grad_accum 2 + bf16; fsdp 4 x tp 2.
Python: the interpreter running this script (e.g. /work/main/.venv/bin/python); override with --python.
"""
from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {
    "default": [],
    "grad_accum2_bf16": ["train.grad_accum=2", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
                         "precision.master_weights=true"],
    "fsdp4_tp2": ["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"],
}

_DUMP = r"""
import sys
from pathlib import Path
import jax
jax.config.update("jax_threefry_partitionable", True)
import jaxmem
repo, out, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
assert Path(jaxmem.__file__).resolve().is_relative_to(repo.resolve()), (jaxmem.__file__, repo)
cfg = jaxmem.load_config(str(repo / "configs" / "tiny.yaml"), sys.argv[4:])
prog = jaxmem.build_program(cfg)
(out / f"{name}.mlir").write_text(prog.lower().as_text())
print(f"{name}: lowered with {jaxmem.__file__}")
"""


def dump(repo: Path, out: Path, python: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(repo), JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    for name, overrides in CASES.items():
        done = subprocess.run([python, "-c", _DUMP, str(repo), str(out), name, *overrides], env=env, cwd=repo,
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"lowered_check: {name} failed in {repo}:\n{done.stderr[-3000:]}")
        print(done.stdout.strip())


def compare(a: Path, b: Path) -> int:
    differ = 0
    for name in CASES:
        ta, tb = (a / f"{name}.mlir").read_text(), (b / f"{name}.mlir").read_text()
        ha, hb = (hashlib.sha256(t.encode()).hexdigest()[:16] for t in (ta, tb))
        same = ta == tb
        differ += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(ta)} bytes sha256 {ha} vs {len(tb)} bytes {hb})")
        if not same:
            sys.stdout.writelines(list(difflib.unified_diff(ta.splitlines(True), tb.splitlines(True), "before",
                                                            "after", n=1))[:40])
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", action="store_true", help="REPO OUT_DIR: dump one checkout")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("paths", nargs=2)
    args = parser.parse_args(argv)
    first, second = (Path(p).resolve() for p in args.paths)
    if args.dump:
        dump(first, second, args.python)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        dump(first, Path(tmp) / "before", args.python)
        dump(second, Path(tmp) / "after", args.python)
        return compare(Path(tmp) / "before", Path(tmp) / "after")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
