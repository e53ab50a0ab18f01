"""ptxas with a cache of its outputs, for deviceless GPU compiles.

A deviceless compile of a training step runs ptxas once per kernel, each a process of its own: a large share
of the compile's time (benchmarks/ptxas_cache.md). Compiles of related programs share most kernels (the remat
presets of one step), so a compile after the first takes less with this cache, and the same program again
less still (benchmarks/ptxas_cache.md). The figures come out the same (they are XLA's buffer assignment, made
before ptxas runs).

`install()` puts a small shell script named ptxas first on PATH (and, where jax hands XLA a CUDA directory of
its own, a directory that looks like it). The script keys each call by the PTX's sha256, under a folder for
the real ptxas's path and `--version`; on a hit (same PTX, same arguments but the file names) it copies the
stored cubin and replays ptxas's output instead of running it. Same input, same compiler: same cubin. A miss
costs a hash and a copy more than ptxas alone.

Off unless `JAXMEM_PTXAS_CACHE` names a directory; subprocesses inherit it. The test suite does not set it:
its extra processes per ptxas run (the script, sha256sum, cp) once met a fork failure in CI, and it saves a
cold suite little (benchmarks/ptxas_cache.md). `jaxmem sweep` and `jaxmem tune` turn it on for their
workers, in their cache folder. Entries are written atomically (a cubin appears only once its output is
stored). The cache is not pruned: it holds each distinct kernel once (its size after a whole test-suite run:
benchmarks/constants.md, ptxas_cache).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from pathlib import Path

from jaxmem.runtime import env_folder

ENV = "JAXMEM_PTXAS_CACHE"

_SCRIPT = r"""#!@SHELL@
# ptxas with a cache, written by jaxmem.runtime.ptxas_cache. An entry is keyed by its PTX's sha256 under a
# folder for the real ptxas and its version; it keeps the arguments it was compiled with (a hit must match
# them), ptxas's stdout and stderr, and the cubin, which is moved in last. Where the key cannot be had, the
# real ptxas runs in this process's place.
REAL=@REAL@
CACHE=@CACHE@
in=; out=; prev=; args=
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out=$a
  elif [ "$a" != "-o" ]; then
    case $a in -*) args="$args $a";; *) [ -n "$in" ] && exec "$REAL" "$@"; in=$a;; esac
  fi
  prev=$a
done
if [ -z "$in" ] || [ -z "$out" ] || [ ! -f "$in" ]; then exec "$REAL" "$@"; fi
key=$(sha256sum "$in") && [ -n "$key" ] || exec "$REAL" "$@"
entry="$CACHE/${key%% *}"
if [ -f "$entry.cubin" ] && IFS= read -r stored < "$entry.args" && [ "$stored" = "$args" ] && cp "$entry.cubin" "$out"; then
  if [ -s "$entry.out" ]; then cat "$entry.out"; fi
  if [ -s "$entry.err" ]; then cat "$entry.err" >&2; fi
  echo "${key%% *}" >> "$CACHE/hits.log"
  exit 0
fi
tmp="$entry.tmp$$"
"$REAL" "$@" >"$tmp.out" 2>"$tmp.err"; rc=$?
if [ -s "$tmp.out" ]; then cat "$tmp.out"; fi
if [ -s "$tmp.err" ]; then cat "$tmp.err" >&2; fi
if [ $rc -eq 0 ] && [ ! -f "$entry.cubin" ] && cp "$out" "$tmp.cubin"; then
  echo "$args" > "$tmp.args"
  for part in out err; do  # ptxas is mostly silent: empty outputs are not kept
    if [ -s "$tmp.$part" ]; then mv "$tmp.$part" "$entry.$part"; fi
  done
  mv "$tmp.args" "$entry.args" && mv "$tmp.cubin" "$entry.cubin"
fi
rm -f "$tmp.out" "$tmp.err" "$tmp.cubin" "$tmp.args"
exit $rc
"""


def directory() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value).absolute() if value else None


def _jax_cuda_root() -> str | None:
    """The CUDA directory jax hands XLA with every compile (CUDA_ROOT, or the nvidia nvcc wheel), if any."""
    from jax._src import lib

    return getattr(lib, "cuda_path", None)


def real_ptxas() -> Path | None:
    """The ptxas XLA would run: in jax's CUDA directory if it names one, else the first on PATH (XLA prefers
    PATH), else /usr/local/cuda's. Our own script is skipped."""
    root = _jax_cuda_root()
    candidates = [Path(root) / "bin" / "ptxas"] if root else []
    ours = directory()
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry and (ours is None or not Path(entry).absolute().is_relative_to(ours)):
            candidates.append(Path(entry) / "ptxas")
    candidates.append(Path("/usr/local/cuda/bin/ptxas"))
    return next((c.resolve() for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def _shell() -> str:
    """bash where there is one: when a fork fails for want of processes (EAGAIN), bash waits and tries again
    (for longer each time) where dash gives up at once ("Cannot fork", seen in CI under the test suite's
    load)."""
    return "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"


def _write_atomically(path: Path, text: str, mode: int) -> None:
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def install() -> Path | None:
    """Puts the caching ptxas in front of the real one for this process and its children; returns the
    cache directory, or None where the cache is off or no ptxas is found (compiles then run as before)."""
    cache = directory()
    real = real_ptxas() if cache is not None else None
    if real is None:
        return None
    version = subprocess.run([str(real), "--version"], capture_output=True, text=True).stdout
    salt = hashlib.sha256(f"{real}\n{version}".encode()).hexdigest()[:16]
    root = cache / "cuda"  # a CUDA directory: our bin/ptxas, the rest of the real one's linked
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (cache / salt).mkdir(exist_ok=True)
    script = (_SCRIPT.replace("@SHELL@", _shell()).replace("@REAL@", shlex.quote(str(real)))
              .replace("@CACHE@", shlex.quote(str(cache / salt))))
    _write_atomically(root / "bin" / "ptxas", script, 0o755)
    # the rest of the real CUDA directory: libdevice (nvvm/), which XLA reads from the directory it is given,
    # and the other tools it runs
    for link, target in ((root / "nvvm", real.parent.parent / "nvvm"),
                         *((root / "bin" / tool, real.parent / tool) for tool in ("nvlink", "fatbinary"))):
        if target.exists() and not link.exists():
            try:
                link.symlink_to(target)
            except FileExistsError:  # another process made it first
                pass
    bin_dir = str(root / "bin")
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    if _jax_cuda_root() is not None:  # jax names XLA's CUDA directory itself: ours, which links the rest
        from jax._src import lib

        lib.cuda_path = str(root)
    return cache


def defaulted_to(folder: Path):
    """Within the block, the cache is on in `folder` unless JAXMEM_PTXAS_CACHE already names one: sweep and
    tune hand it to their worker processes, whose deviceless compiles of one model share most kernels."""
    return env_folder.defaulted(ENV, folder)


def hits(cache: Path) -> int:
    """How many ptxas runs the cache has answered (one line per hit in hits.log)."""
    return sum(1 for log in cache.glob("*/hits.log") for _ in log.open())
