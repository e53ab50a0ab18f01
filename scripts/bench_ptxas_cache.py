"""What the ptxas cache saves a deviceless compile (jaxmem.runtime.ptxas_cache), measured on this CPU machine.

For each remat preset of one model (a two-layer Llama-3.2-1B-width step on one H100, deviceless), in a fresh
process each, the compile's seconds and ptxas's calls:
  - without the cache;
  - with a cache filled by the presets compiled before it (what a sweep over remat presets meets);
  - with the cache already holding this very program (a repeat: a second plan of the same config).
The compiled device bytes are checked equal in all three: ptxas runs after XLA's buffer assignment.

Writes benchmarks/ptxas_cache.json and .md:  python scripts/bench_ptxas_cache.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ("none", "selective", "full", "offload_layer_inputs")
MODEL = ["model.preset=llama3.2-1b", "model.n_layers=2", "train.seq_len=1024", "train.micro_batch=1",
         "parallel.fsdp=1", "target.name=h100-80g", "target.gpus_per_host=1"]

_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
jax.config.update("jax_enable_compilation_cache", False)
from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.runtime.compiled_memory import read_fields
from jaxmem.runtime.aot import resolve_topology
cfg = load_config(None, sys.argv[1:])
prog = build_program(cfg, devices=list(resolve_topology(cfg, None, None, None).devices()))
lowered = prog.lower()
start = time.perf_counter()
fields = read_fields(lowered.compile())
print(json.dumps({"compile_s": round(time.perf_counter() - start, 2), "fields": fields}))
"""


def _compile(preset: str, cache: str, counter: Path) -> dict:
    """One compile in a fresh process; ptxas's calls are counted by a PATH shim around whatever ptxas is used."""
    env = dict(os.environ, JAXMEM_PTXAS_CACHE=cache, JAX_DISABLE_MOST_OPTIMIZATIONS="1", PYTHONPATH=str(ROOT))
    env["PATH"] = f"{counter.parent}{os.pathsep}{env['PATH']}"
    counter.write_text("")
    out = subprocess.run([sys.executable, "-c", _CHILD, *MODEL, f"remat.preset={preset}"], env=env,
                         capture_output=True, text=True, check=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row["ptxas_runs"] = len(counter.read_text().splitlines())
    return row


def _counting_shim(folder: Path, real: str) -> Path:
    """A ptxas that logs each compile it is asked for, then runs the real one (--version calls not counted)."""
    shim = folder / "ptxas"
    log = folder / "runs.log"
    shim.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] || echo run >> "{log}"\nexec "{real}" "$@"\n')
    shim.chmod(0o755)
    return log


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from jaxmem.runtime.ptxas_cache import real_ptxas

    real = real_ptxas()
    if real is None:
        print("no ptxas on this machine: nothing to measure")
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shim_dir = Path(tmp) / "shim"
        shim_dir.mkdir()
        counter = _counting_shim(shim_dir, str(real))
        cache = str(Path(tmp) / "cache")
        for preset in PRESETS:
            plain = _compile(preset, "", counter)
            shared = _compile(preset, cache, counter)  # the cache holds the presets compiled before this one
            repeat = _compile(preset, cache, counter)
            same = plain["fields"] == shared["fields"] == repeat["fields"]
            rows.append({"remat": preset, "no_cache_s": plain["compile_s"], "shared_s": shared["compile_s"],
                         "repeat_s": repeat["compile_s"], "ptxas_runs": plain["ptxas_runs"],
                         "ptxas_runs_shared": shared["ptxas_runs"], "ptxas_runs_repeat": repeat["ptxas_runs"],
                         "same_figures": same})
            print(rows[-1], flush=True)
    bench = ROOT / "benchmarks"
    meta = {"how": "measured on CPU (this 2-core machine; deviceless compile for 1 x h100-80g, one process each)",
            "model": MODEL, "ptxas": str(real)}
    (bench / "ptxas_cache.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# ptxas cache: deviceless compile seconds (measured on CPU)", "",
             f"Two-layer Llama-3.2-1B-width step, one H100 target, deviceless; {meta['how']}. `shared`: the cache "
             "holds the presets above this row (a sweep over remat); `repeat`: it holds this program too. "
             "ptxas runs counted at the real ptxas (the cache's hits never reach it). Produced by "
             "`scripts/bench_ptxas_cache.py`.", "",
             "| remat | no cache s | shared s | repeat s | ptxas runs | shared | repeat | same figures |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['remat']} | {r['no_cache_s']} | {r['shared_s']} | {r['repeat_s']} | {r['ptxas_runs']} "
                     f"| {r['ptxas_runs_shared']} | {r['ptxas_runs_repeat']} | {r['same_figures']} |")
    (bench / "ptxas_cache.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["same_figures"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
