"""A CPU host's device count (jaxmem.runtime.cpu_host.give_mesh_its_devices): set to what the mesh takes before
jax's backend starts, else one line naming the flag."""
import os

import pytest

from jaxmem.config import ConfigError, ParallelConfig
from jaxmem.runtime import cpu_host

FLAG = "--xla_force_host_platform_device_count"


@pytest.fixture
def fresh(monkeypatch):
    """A CPU host whose backend has not started and whose environment sets no device count."""
    monkeypatch.setattr(cpu_host, "_backend_devices", lambda: None)
    monkeypatch.setattr(cpu_host, "has_gpu", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    monkeypatch.delenv("NPROC", raising=False)
    return monkeypatch


def test_the_mesh_gets_its_devices(fresh):
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=4, tp=2, rules="fsdp_tp"))
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_multi_thread_eigen=false {FLAG}=8"
    assert os.environ["NPROC"] == str(max(os.cpu_count(), 8 * cpu_host.THREADS_PER_DEVICE))  # room for collectives


def test_a_fill_axis_takes_what_the_other_axes_leave(fresh):
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=-1, tp=2))  # the fixed axes' product: fsdp fills 1
    assert os.environ["XLA_FLAGS"].endswith(f"{FLAG}=2")
    fresh.setenv("XLA_FLAGS", "")
    fresh.delenv("NPROC")
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=-1))  # nothing fixed: jax's default stays
    assert os.environ["XLA_FLAGS"] == "" and "NPROC" not in os.environ


def test_each_process_gets_its_share(fresh):
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=4, pp=2), processes=2)
    assert os.environ["XLA_FLAGS"].endswith(f"{FLAG}=4")


def test_a_count_the_user_set_wins_where_the_mesh_takes_it(fresh):
    fresh.setenv("XLA_FLAGS", f"{FLAG}=8")
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=-1, tp=2))  # 8 = fsdp 4 x tp 2
    assert os.environ["XLA_FLAGS"] == f"{FLAG}=8"
    with pytest.raises(ConfigError) as e:
        cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=2, tp=2))
    assert str(e.value) == (f"parallel: the mesh takes 4 CPU devices but XLA_FLAGS asks for 8; set "
                            f"XLA_FLAGS={FLAG}=4 (or unset it: jaxmem then sets it)")
    fresh.setenv("XLA_FLAGS", "")
    fresh.setenv("JAX_NUM_CPU_DEVICES", "3")
    with pytest.raises(ConfigError, match=f"JAX_NUM_CPU_DEVICES asks for 3; set XLA_FLAGS={FLAG}=4"):
        cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=-1, tp=4))


def test_a_started_backend_gets_the_line_to_set(fresh):
    fresh.setattr(cpu_host, "_backend_devices", lambda: 1)
    with pytest.raises(ConfigError) as e:
        cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=4, tp=2))
    assert "\n" not in str(e.value) and str(e.value).endswith(f"set XLA_FLAGS={FLAG}=8 before jax starts")
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"


def test_a_gpu_run_is_left_alone(fresh):
    fresh.setattr(cpu_host, "on_cpu", lambda: False)
    cpu_host.give_mesh_its_devices(ParallelConfig(fsdp=8))
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"
