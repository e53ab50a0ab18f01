"""`jaxmem doctor`: machine checks on CPU, and each config check fed the numbers directly (no compiles)."""
import json

import jax
import pytest

from jaxmem.cli import doctor
from jaxmem.loader import load_config
from jaxmem.config.schema import ConfigError, DistributedConfig

GIB = 1024**3
H100 = 84_929_347_584  # targets.h100-80g hbm_bytes


def by_name(checks):
    return {c["name"]: c for c in checks}


def test_no_config_json_and_gpu_checks_skip(tmp_path):
    out = tmp_path / "doctor.json"
    assert doctor.main(["--json", str(out)]) == 0
    checks = json.loads(out.read_text())
    assert [set(c) for c in checks] == [{"name", "status", "detail"}] * len(checks)
    got = by_name(checks)
    assert list(got) == ["platform", "jax", "cuda plugin", "cudnn", "host AdamW", "allocator", "pinned host",
                         "host RAM", "distributed"]
    assert got["host AdamW"]["status"] == "ok" and "host_adamw-" in got["host AdamW"]["detail"]  # g++ is here
    assert got["platform"]["status"] == "ok"
    assert got["platform"]["detail"] == f"{jax.device_count()} x cpu (cpu); cpu only: GPU checks skipped"
    assert f"jax {jax.__version__}" in got["jax"]["detail"] and ">=0.10.2,<0.13" in got["jax"]["detail"]
    assert got["pinned host"]["status"] == "skip" and "pinned_host" in got["pinned host"]["detail"]
    for name in ("allocator", "host RAM", "distributed"):
        assert got[name]["status"] == "skip" and "no config given" in got[name]["detail"]
    assert all(c["status"] != "fail" for c in checks)


def test_tiny_config_ok():
    got = by_name(doctor.run_checks(load_config("configs/tiny.yaml", []), env={}, ram=24 * GIB))
    assert got["host RAM"]["status"] == "ok" and "MemTotal 24.0 GiB" in got["host RAM"]["detail"]
    assert got["allocator"]["status"] == "skip"  # no target, no GPU
    assert got["distributed"] == {"name": "distributed", "status": "ok", "detail": "single process"}


def test_qwen72b_host_ram_fails_here(tmp_path, capsys):
    cfg = load_config("configs/qwen2-72b-8xh100.yaml", [])
    got = by_name(doctor.run_checks(cfg, env={}, ram=24 * GIB))
    ram = got["host RAM"]
    assert ram["status"] == "fail"
    assert "plan needs 1132.7 GiB of host memory per node" in ram["detail"]
    assert "(141.6 GiB per device x 8 devices); MemTotal 24.0 GiB" in ram["detail"]
    # the CLI on this machine (24 GiB): exit 1, the line printed
    out = tmp_path / "d.json"
    assert doctor.main(["configs/qwen2-72b-8xh100.yaml", "--json", str(out)]) == 1
    assert "fail  host RAM" in capsys.readouterr().out
    assert by_name(json.loads(out.read_text()))["host RAM"]["status"] == "fail"


def test_host_ram_warns_above_90_percent():
    c = doctor.check_host_ram(int(9.5 * GIB), 10 * GIB, int(1.1875 * GIB), 8)
    assert c["status"] == "warn" and "9.5 GiB" in c["detail"] and "MemTotal 10.0 GiB" in c["detail"]
    assert doctor.check_host_ram(8 * GIB, 10 * GIB, GIB, 8)["status"] == "ok"


def test_allocator_check_applies_the_rule_train_applies():
    """Unset: jaxmem train derives the fraction (plan / HBM + headroom), so the check passes and names the
    exports a script of one's own needs; a user's too-small fraction warns with the one that fits."""
    c = doctor.check_allocator({}, H100, 70 * GIB, " (h100-80g)")
    assert c["status"] == "ok"
    assert "plan needs 70.0 GiB per device, estimated (analytic), = 88% of 79.1 GiB HBM" in c["detail"]
    assert "allocator cap 0.885 x HBM = 70.0 GiB" in c["detail"]
    assert c["detail"].endswith("(jaxmem train sets it; your own scripts need: export XLA_PYTHON_CLIENT_PREALLOCATE="
                                "false; export XLA_PYTHON_CLIENT_MEM_FRACTION=0.885)")
    low = doctor.check_allocator({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}, H100, 70 * GIB, "", 0.05)
    assert low["status"] == "warn"
    assert low["detail"].endswith("lets XLA use 59.3 GiB of 79.1 GiB, but the plan needs 70.0 GiB per device "
                                  "(estimated (analytic)): export XLA_PYTHON_CLIENT_MEM_FRACTION=0.935 or unset it")
    over = doctor.check_allocator({}, H100, int(0.97 * H100))  # above the 0.95 XLA may take
    assert over["status"] == "warn" and "the run will not fit" in over["detail"]


def test_allocator_raised_fraction_ok(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    c = doctor.check_allocator(doctor.os.environ, H100, 70 * GIB)
    assert c["status"] == "ok"
    assert c["detail"].startswith("XLA_PYTHON_CLIENT_PREALLOCATE=false, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95;")
    assert "allocator cap 0.95 x HBM = 75.1 GiB" in c["detail"] and "jaxmem train sets" not in c["detail"]
    assert doctor.check_allocator({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, H100, 78 * GIB)["status"] == "ok"


def test_allocator_with_config_target():
    cfg = load_config("configs/llama3-8b-8xh100.yaml", [])
    got = by_name(doctor.run_checks(cfg, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, ram=24 * GIB))
    assert got["allocator"]["status"] == "ok" and "(h100-80g)" in got["allocator"]["detail"]
    assert got["host RAM"]["status"] == "ok"


def test_distributed_mismatch_fails():
    bad = DistributedConfig(coordinator="10.0.0.1:1234", num_processes=2, process_id=2)
    c = doctor.check_distributed(bad, 8, 1, {})
    assert c["status"] == "fail" and "process_id: 2 is not in [0, distributed.num_processes=2)" in c["detail"]
    three = DistributedConfig(coordinator="10.0.0.1:1234", num_processes=3, process_id=0)
    assert doctor.check_distributed(three, 8, 1, {})["detail"].endswith("8 devices do not split over 3 processes")
    two = DistributedConfig(coordinator="10.0.0.1:1234", num_processes=2, process_id=1)
    assert doctor.check_distributed(two, 16, 2, {})["detail"] == ("coordinator 10.0.0.1:1234, process 1 of 2, "
                                                                  "8 devices each")
    lone = doctor.check_distributed(DistributedConfig(), 16, 2, {})
    assert lone["status"] == "fail" and "target.hosts=2 but no process group" in lone["detail"]
    slurm = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert doctor.check_distributed(DistributedConfig(), 16, 2, slurm)["detail"].startswith("SLURM: 2 tasks")


class FakeMemory:
    def __init__(self, kind):
        self.kind = kind


class FakeGpu:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, kinds):
        self.kinds = kinds

    def addressable_memories(self):
        return [FakeMemory(k) for k in self.kinds]


def test_pinned_host():
    assert doctor.check_pinned_host([FakeGpu(["device", "pinned_host"])], True)["status"] == "ok"
    c = doctor.check_pinned_host([FakeGpu(["device"])], True)
    assert c["status"] == "fail" and c["detail"].startswith("memory kinds: device: the config offloads")
    assert doctor.check_pinned_host([FakeGpu(["device"])], False)["status"] == "warn"


def test_bad_config_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        doctor.main([str(tmp_path / "missing.yaml")])
    with pytest.raises(ConfigError):
        doctor.main(["configs/tiny.yaml", "target.name=nope"])


def test_host_kernel_without_a_compiler_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMEM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    got = doctor.check_host_kernel(on_gpu=False)
    assert got["status"] == "warn" and "no C++ compiler" in got["detail"] and "XLA's code" in got["detail"]
    got = doctor.check_host_kernel(on_gpu=True)
    assert got["status"] == "warn" and "a GPU program's host update runs XLA's code" in got["detail"]


def test_host_kernel_on_a_gpu_is_registered_with_the_cuda_plugin():
    pytest.importorskip("jax_cuda12_plugin")
    got = doctor.check_host_kernel(on_gpu=True)
    assert got["status"] == "ok" and "registered for the GPU's host programs" in got["detail"], got
