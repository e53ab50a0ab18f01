"""Eight virtual CPU devices and a shared compilation cache for every test; set before jax is imported.

The persistent cache lives in the checkout (`.cache/jax-tests`, git-ignored), so a fresh clone starts cold;
within one run the xdist workers and the subprocesses the tests start (multi-process training, sweep
workers, explain dumps) reuse each other's CPU compiles of the same program. Compile-only GPU executables
cannot be read back from it (jax 0.10.2: "PjRtCompiler must be constructed with a Client"); jax then
compiles again, so those deviceless compiles are shared through fixtures instead.

`JAX_DISABLE_MOST_OPTIMIZATIONS` lowers XLA's backend (LLVM) optimization level: CPU compiles take ~40%
less time and every test compares programs compiled the same way. It leaves the HLO passes alone, so the
deviceless GPU figures (buffer assignment, collectives) the tests check are the ones `jaxmem plan` reports
(checked: the same device bytes for a Llama-3-8B step with and without it).

`--xla_cpu_enable_concurrency_optimized_scheduler=false`: with XLA's concurrency-optimized CPU scheduler
(jax 0.10.2) an executable read back from the persistent cache can run two independent collectives in a
different order on different virtual devices; they deadlock until XLA's 40 s rendezvous timeout aborts the
process ("Expected 8 threads to join the rendezvous, but only 7 of them arrived", one device waiting in an
all-gather while seven wait in an all-reduce). Seen on the fsdp=8 update-in-backward step on its second
cached run, every time, and once in the mesh-layout tests; with this flag, none in repeated runs.

`--xla_cpu_multi_thread_eigen=false`: each virtual device runs its dots on its own thread, not through a shared
Eigen pool; eight device threads per process and two xdist workers already fill the two cores. Test by test
against a cold run without it (-n 2, measured on this 2-core machine): 2162 s against 2330 s over the suite's
first 184 tests (slower in 55 of them), and 530 against 632 worker-seconds over test_lora, test_parallel,
test_levers, test_moe and test_kernels_attention. Only runs of the same hour compare here: with no flag
changed that touches them, the suite's first 274 tests took 2337 s in one cold run and 1883 s in another 1.5
hours earlier.

`--xla_cpu_use_fusion_emitters=false` (XLA:CPU's older loop emitters; jaxlib 0.10.x has the flag, 0.12 does not
and aborts on it, so it is set below 0.11 only) and `--xla_cpu_parallel_codegen_split_count=1` (LLVM codegen on
the compiling thread: two xdist workers already fill the two cores): cold, -n 2, on this 2-core machine,
test_lora + test_update_in_backward took 184 s (301 CPU-s, 197 s in 745 backend compiles) with neither, 124 s
(190 CPU-s, 96 s compiling) with the first, 121 s (179 CPU-s, 88 s) with both; every test passes. Tried in an
earlier session, 6 update-in-backward comparisons failed at 1e-6; their tolerances allow another fusion order's
last-bit fp32 differences since (jax 0.12 showed the same).
"""
import os
from importlib.metadata import version
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
flags = os.environ.get("XLA_FLAGS", "")
# JAXMEM_TEST_DEVICES=1 (`make test-unit`): the unit tier on one device, so a test there that compiles a
# multi-device program fails instead of passing unnoticed (tests that need meshes live in tests/integration).
DEVICES = int(os.environ.get("JAXMEM_TEST_DEVICES", "8"))
suite_flags = [f"--xla_force_host_platform_device_count={DEVICES}", "--xla_cpu_enable_concurrency_optimized_scheduler=false",
               "--xla_cpu_multi_thread_eigen=false", "--xla_cpu_parallel_codegen_split_count=1"]
if tuple(int(p) for p in version("jaxlib").split(".")[:2]) < (0, 11):
    suite_flags.append("--xla_cpu_use_fusion_emitters=false")
for flag in suite_flags:
    if flag.split("=")[0] not in flags:  # a flag already set in the environment wins
        flags += " " + flag
os.environ["XLA_FLAGS"] = flags.strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAXMEM_PLAN_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "plans"))
# deviceless compiles' figures by lowered text + target + versions + flags (jaxmem.plan.figure_cache): the
# persistent cache above cannot hold those executables, so a plan compiled by one test (or a sweep or tune
# worker) is not compiled again by the next
os.environ.setdefault("JAXMEM_FIGURE_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "figures"))

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture(scope="session")
def built_once(tmp_path_factory):
    """`built_once(name, build)`: a directory that `build(directory)` fills once per test run, shared by the
    xdist workers. A module fixture runs once per worker that needs it, and a deviceless compile (which the
    persistent cache cannot hold) would run on both; the first worker to ask builds it under a file lock,
    the other waits, then reads."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above the per-worker ones

    def directory(name: str, build) -> Path:
        path = root / name
        with FileLock(str(path) + ".lock"):
            if not (path / ".built").exists():
                path.mkdir(exist_ok=True)
                build(path)
                (path / ".built").touch()
        return path

    return directory


# ---------------------------------------------------------------- scheduling: slow files first, fixtures once
#
# `make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: each file's tests run on one worker, so a
# fixture of module scope is built once per run, not once per worker that gets one of the file's tests
# (with worksteal it was built on both). Files start slowest first by tests/durations.json (each file's
# seconds in a recorded run: JAXMEM_RECORD_DURATIONS=<file> records one, scripts/test_durations.py writes
# the JSON), so the long files never start last and the short ones fill in the end. A file keeps its tests
# in their order; files the record does not know (new ones) go last, in collection order.
# (`--dist loadgroup` would let files without module fixtures spread per test, but its xdist_group marks
# set `item._nodeid`, which pytest 9 no longer reads: the groups were silently ignored.)
DURATIONS = Path(__file__).resolve().parent / "durations.json"


def pytest_collection_modifyitems(config, items):
    import json

    seconds = json.loads(DURATIONS.read_text())["files"] if DURATIONS.is_file() else {}
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path.name, i)
    items.sort(key=lambda item: (-seconds.get(item.path.name, 0.0), first_seen[item.path.name]))


def pytest_runtest_logreport(report):
    path = os.environ.get("JAXMEM_RECORD_DURATIONS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller sees every worker's reports
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid, "when": report.when, "seconds": report.duration}) + "\n")


if os.environ.get("JAXMEM_PROFILE_COMPILES"):  # a profiling run: which compiles repeat, and what they cost
    # Every backend compile (jit, eager ops, deviceless GPU), at the one function jax 0.10-0.12 routes them
    # through; scripts/suite_compiles.py sums the lines per file and finds the programs compiled twice.
    import hashlib
    import json
    import time

    from jax._src import compiler as _jax_compiler

    _backend_compile = _jax_compiler.backend_compile_and_load

    def _log(start: float, **record) -> None:
        """One line of the profile: the running test, the record, and the seconds since `start`."""
        with open(os.environ["JAXMEM_PROFILE_COMPILES"], "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0], **record,
                                "seconds": round(time.perf_counter() - start, 3)}) + "\n")

    def _logged_compile(backend, module, *args, **kwargs):
        start = time.perf_counter()
        out = _backend_compile(backend, module, *args, **kwargs)
        _log(start, module=str(module.operation.attributes["sym_name"]).strip('"'),
             platform=getattr(backend, "platform", "?"), key=hashlib.sha256(str(module).encode()).hexdigest()[:16])
        return out

    _jax_compiler.backend_compile_and_load = _logged_compile

    def _logged_cache(kind, original):
        """The persistent cache's reads (hit or miss) and writes, with their seconds: what the cache costs."""
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            _log(start, kind=kind, hit=out[0] is not None if kind == "cache_read" else None)
            return out
        return call

    _jax_compiler._cache_read = _logged_cache("cache_read", _jax_compiler._cache_read)
    _jax_compiler._cache_write = _logged_cache("cache_write", _jax_compiler._cache_write)
