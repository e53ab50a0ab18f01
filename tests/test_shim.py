"""The jax-internals shim for host placement on compile-only devices: fails loudly when jax changes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem import memory_kinds_shim as shim


def test_shim_is_pinned_to_the_jax_version_it_was_written_for():
    # When jax is upgraded this fails first: re-check both private hooks, then bump SUPPORTED_JAX.
    assert jax.__version__ == shim.SUPPORTED_JAX


def test_other_jax_versions_are_refused(monkeypatch):
    monkeypatch.setattr(shim, "_installed", False)
    monkeypatch.setattr(jax, "__version__", "9.9.9")
    with pytest.raises(shim.ShimUnsupported, match="supports jax 0.10.2 only"):
        shim.install()


def test_real_cpu_devices_need_no_patch():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    s = shim.host_sharding(NamedSharding(mesh, P("x")))
    assert s.memory_kind == "pinned_host" and shim.is_host(s)
    assert not shim.is_host(NamedSharding(mesh, P("x")))


def test_compile_only_h100_places_arguments_and_results_on_host():
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem import aot

    devices = aot.target_devices("h100-80g", 2)
    mesh = Mesh(np.array(devices), ("x",))
    device = NamedSharding(mesh, P("x"))
    assert not shim.has_memory_spaces(device)
    host = shim.host_sharding(device)
    assert shim.is_host(host) and not shim.is_host(device)

    def step(w_host, x):
        w = jax.device_put(w_host, jax.memory.Space.Device)
        return jax.device_put(w * 2, jax.memory.Space.Host), x + 1

    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=host)
    x = jax.ShapeDtypeStruct((16, 1024), jnp.float32, sharding=device)
    compiled = jax.jit(step, in_shardings=(host, device), out_shardings=(host, device),
                       donate_argnums=(0,)).lower(w, x).compile()
    ma = compiled.memory_analysis()
    half = 1024 * 1024 * 4 // 2  # per device
    assert ma.host_argument_size_in_bytes == half, ma
    assert ma.host_output_size_in_bytes == half, ma
    assert ma.argument_size_in_bytes == 16 * 1024 * 4 // 2, ma  # only x stays on the device
    layout = next(line for line in compiled.as_text().splitlines() if "entry_computation_layout" in line)
    assert "S(5)" in layout
