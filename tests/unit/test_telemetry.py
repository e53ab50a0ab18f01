"""Device-memory telemetry of `jaxmem train`: stubbed allocator stats, warnings once, CPU run, memory profile."""
import jax

from jaxmem.train import telemetry
from jaxmem.train.metrics import read_jsonl
from jaxmem.train.telemetry import MemoryTelemetry
from jaxmem.train import run

from tiny_config import tiny_config as _cfg

GIB = 2**30


class _FakeDevice:
    """A device whose memory_stats() returns the next of `stats` (the last one repeats)."""

    def __init__(self, *stats):
        self.stats = list(stats)

    def memory_stats(self):
        return self.stats.pop(0) if len(self.stats) > 1 else self.stats[0]


def _stats(in_use, peak=6 * GIB, limit=16 * GIB, free_block=12 * GIB):
    return {"bytes_in_use": in_use, "peak_bytes_in_use": peak, "bytes_limit": limit,
            "largest_free_block_bytes": free_block, "num_allocs": 7}


def test_warnings_fire_once_and_the_record_holds_the_stubbed_numbers():
    notes = []
    healthy = _stats(4 * GIB)
    leaking = [_stats(4 * GIB + n * GIB // 2, free_block=GIB) for n in range(1, 4)]  # also fragmented
    devices = [_FakeDevice(healthy, *leaking), _FakeDevice(_stats(3 * GIB, peak=5 * GIB))]
    mem = MemoryTelemetry(argument_bytes=4 * GIB, device_total=8 * GIB, devices=devices, note=notes.append)

    first = mem.sample()
    assert first == {"mem/bytes_in_use": 4 * GIB, "mem/bytes_in_use_per_device": [4 * GIB, 3 * GIB],
                     "mem/peak_bytes_in_use": 6 * GIB, "mem/peak_bytes_in_use_per_device": [6 * GIB, 5 * GIB],
                     "mem/bytes_limit": 16 * GIB, "mem/bytes_limit_per_device": [16 * GIB, 16 * GIB],
                     "mem/largest_free_block_bytes": 12 * GIB,
                     "mem/largest_free_block_bytes_per_device": [12 * GIB, 12 * GIB],
                     "plan/argument_bytes": 4 * GIB, "plan/device_bytes": 8 * GIB}
    assert notes == [] and mem.warnings == {}

    records = [mem.sample() for _ in range(4)]
    assert records[0]["mem/warnings"] == ["leak", "fragmentation"]
    assert all("mem/warnings" not in r for r in records[1:])
    assert records[0]["mem/bytes_in_use"] == 4 * GIB + GIB // 2
    assert records[-1]["mem/bytes_in_use_per_device"] == [4 * GIB + 3 * GIB // 2, 3 * GIB]
    assert records[-1]["mem/largest_free_block_bytes"] == GIB
    assert [n.split(")")[0] for n in notes] == ["memory warning (leak", "memory warning (fragmentation"]
    assert set(mem.warnings) == {"leak", "fragmentation"}  # no peak: 6 GiB <= 8 GiB

    mem.devices = [_FakeDevice(_stats(GIB, peak=9 * GIB))]
    assert mem.sample()["mem/warnings"] == ["peak"] and "mem/warnings" not in mem.sample()
    assert len(notes) == 3 and "8.00 GiB" in notes[-1]


def test_no_stats_means_no_fields():
    mem = MemoryTelemetry(4, 8, devices=[_FakeDevice(None), _FakeDevice({})], note=print)
    assert mem.sample() == {} and mem.warnings == {}


def test_stubbed_run_writes_the_device_stats_next_to_the_compiled_figures(tmp_path, monkeypatch):
    stats = _stats(10 * GIB, free_block=GIB)
    monkeypatch.setattr(telemetry, "_local_devices", lambda: [_FakeDevice(stats) for _ in jax.local_devices()])
    cfg = _cfg(tmp_path, "train.steps=3", "train.log_every=1", "checkpoint.enabled=false", "train.seq_len=32")
    summary = run(cfg)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records == summary["records"] and len(records) == 3
    n = len(jax.local_devices())
    for r in records:
        assert r["mem/bytes_in_use"] == 10 * GIB and r["mem/bytes_in_use_per_device"] == [10 * GIB] * n
        assert r["mem/largest_free_block_bytes"] == GIB
        assert 0 < r["plan/argument_bytes"] < r["plan/device_bytes"]
    assert records[0]["mem/warnings"] == ["leak", "peak", "fragmentation"]  # the tiny model is far below
    assert all("mem/warnings" not in r for r in records[1:])
    assert set(summary["memory_warnings"]) == {"leak", "peak", "fragmentation"}


def test_cpu_run_has_no_mem_fields_and_writes_the_memory_profile(tmp_path, capsys):
    cfg = _cfg(tmp_path, "train.steps=2", "train.log_every=1", "checkpoint.enabled=false", "train.seq_len=32",
               "train.memory_profile_at=1")
    summary = run(cfg)
    assert [r["step"] for r in summary["records"]] == [1, 2] and summary["memory_warnings"] == {}
    assert not any(k.startswith(("mem/", "plan/")) for r in summary["records"] for k in r)
    err = capsys.readouterr().err
    profile = tmp_path / "memory_profile_step1.prof"
    # jax gives a pprof profile on CPU too: a gzipped protobuf
    assert profile.read_bytes()[:2] == b"\x1f\x8b" and f"device memory profile after step 1: {profile}" in err
    assert "no device memory profile" not in err


def test_a_backend_without_a_memory_profile_is_one_line_and_no_file(tmp_path, monkeypatch):
    def unsupported():
        raise RuntimeError("device_memory_profile is not implemented\nsecond line")

    monkeypatch.setattr(jax.profiler, "device_memory_profile", unsupported)
    notes = []
    assert telemetry.save_memory_profile(tmp_path, 3, note=notes.append) is None
    assert notes == ["train.memory_profile_at=3: no device memory profile on this backend (RuntimeError: "
                     "device_memory_profile is not implemented); skipped"]
    assert list(tmp_path.iterdir()) == []
