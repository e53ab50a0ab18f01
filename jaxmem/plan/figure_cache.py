"""Compiled memory figures of deviceless compiles, kept by what decides them.

jax's persistent cache cannot read back an executable compiled for compile-only GPU devices (jax 0.10.2:
"PjRtCompiler must be constructed with a Client"), so every plan of the same step compiled it again. This
cache keeps only the figures (XLA's memory analysis fields and the memory warnings its log printed), under
a key of everything the compile reads: the lowered program's text (StableHLO, with its shardings and
device count), the target's description, the jax / jaxlib / CUDA-plugin versions and the XLA flags and
jax settings of this process. Same key, same compile, same figures; any difference is a new entry.

Off unless `JAXMEM_FIGURE_CACHE` names a directory (the test suite sets it, so that a figure is compiled
once per run); `jaxmem sweep` and `jaxmem tune` turn it on in their cache folder (its figures/) for their
points. Entries are small JSON files, written atomically; each hit appends the seconds of the compile it saved
to hits.log there.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from jaxmem.runtime import env_folder

ENV = "JAXMEM_FIGURE_CACHE"
# process settings a compile reads besides the program (jax's own and XLA's)
_SETTINGS = ("XLA_FLAGS", "JAX_DISABLE_MOST_OPTIMIZATIONS", "XLA_PYTHON_CLIENT_MEM_FRACTION")


def defaulted_to(folder: Path):
    """Within the block, the cache is on in `folder` unless JAXMEM_FIGURE_CACHE already names one: sweep and tune
    hand it to their points (in worker processes or in-process), which share the program that builds the step-0
    state (the remat presets of one model: the same init compile) and, across runs, every step already compiled."""
    return env_folder.defaulted(ENV, folder)


def directory() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _versions() -> str:
    import jax
    import jaxlib

    parts = [f"jax {jax.__version__}", f"jaxlib {jaxlib.__version__}"]
    for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin"):
        try:
            from importlib.metadata import version

            parts.append(f"{plugin} {version(plugin.replace('_', '-'))}")
        except Exception:  # noqa: BLE001 (not installed)
            continue
    return ", ".join(parts)


def key(lowered_text: str, target: str) -> str:
    """sha256 of the lowered text, the target's description and the versions and settings of this process."""
    settings = "\n".join(f"{name}={os.environ.get(name, '')}" for name in _SETTINGS)
    h = hashlib.sha256()
    for part in (lowered_text, target, _versions(), settings):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def lookup(cache_key: str) -> dict | None:
    """{"fields", "warnings", "compile_seconds"} of an earlier compile of the same key, or None."""
    where = directory()
    if where is None:
        return None
    path = where / f"{cache_key}.json"
    try:
        hit = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:  # what the cache saved: one line per hit, the compile it did not repeat (hits.log)
        with open(where / "hits.log", "a") as f:
            f.write(f"{cache_key[:16]} {hit['compile_seconds']}\n")
    except OSError:
        pass
    return hit


def store(cache_key: str, fields: dict[str, int], warnings: list[str], compile_seconds: float) -> None:
    where = directory()
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / f".{cache_key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"fields": fields, "warnings": warnings,
                                   "compile_seconds": round(compile_seconds, 2)}))
        tmp.replace(where / f"{cache_key}.json")
    except OSError:
        pass  # a read-only cache: the next plan compiles again
