"""The jax-internals shim for host placement on compile-only devices: fails loudly when jax changes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem.runtime import compat, memory_kinds_shim as shim


def test_running_jax_is_inside_the_checked_range():
    # When jax is upgraded past the range this fails first: re-check both private hooks against the new
    # source, then widen compat.JAX_RANGE.
    assert compat.in_range(jax.__version__, compat.FEATURES[shim.FEATURE])


@pytest.mark.parametrize("version", ["0.10.1", "0.13.0", "1.0.0"])
def test_versions_outside_the_range_are_refused_in_one_line(monkeypatch, version):
    monkeypatch.setattr(shim, "_installed", False)
    monkeypatch.setattr(jax, "__version__", version)
    with pytest.raises(shim.ShimUnsupported) as info:
        shim.install()
    text = str(info.value)
    assert "\n" not in text and f"found jax {version}" in text and ">=0.10.2,<0.13" in text


@pytest.mark.parametrize("version", ["0.10.2", "0.11.0", "0.11.2", "0.12.0.1"])
def test_versions_inside_the_range_install(monkeypatch, version):
    monkeypatch.setattr(shim, "_installed", False)
    monkeypatch.setattr(jax, "__version__", version)
    shim.install()  # the hooks are looked up by name; both exist in 0.10.2, 0.11.2 and 0.12.0.1
    assert shim._installed


def test_real_cpu_devices_need_no_patch():
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    s = shim.host_sharding(NamedSharding(mesh, P("x")))
    assert s.memory_kind == "pinned_host" and shim.is_host(s)
    assert not shim.is_host(NamedSharding(mesh, P("x")))


def test_compile_only_h100_places_arguments_and_results_on_host():
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime import aot

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
