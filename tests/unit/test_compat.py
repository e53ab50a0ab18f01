"""Supported JAX versions: range checks, one-line refusals, and the compute_on spelling of each series."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import cli
from jaxmem.runtime import compat


@pytest.mark.parametrize("text,expected", [("0.10.2", (0, 10, 2)), ("0.11", (0, 11, 0)),
                                           ("0.12.0.1", (0, 12, 0)), ("0.11.0.dev20251010", (0, 11, 0))])
def test_version_tuple(text, expected):
    assert compat.version_tuple(text) == expected


@pytest.mark.parametrize("version,inside", [("0.10.1", False), ("0.10.2", True), ("0.11.2", True),
                                            ("0.11.9", True), ("0.12.0", True), ("0.12.0.1", True),
                                            ("0.13.0", False), ("0.13.0.1", False)])
def test_every_feature_admits_exactly_the_checked_range(version, inside):
    for feature in compat.FEATURES:
        if inside:
            compat.require(feature, version)
        else:
            with pytest.raises(compat.UnsupportedVersion, match=f"found jax {version}"):
                compat.require(feature, version)


def test_cli_prints_one_line_for_an_unsupported_jax(monkeypatch, capsys):
    monkeypatch.setattr(jax, "__version__", "0.13.0")
    monkeypatch.setattr(compat.jax, "__version__", "0.13.0")
    from jaxmem.runtime import aot

    aot.target_devices.cache_clear()
    try:
        code = cli.main(["plan", "configs/tiny.yaml", "--target", "h100-80g", "--gpus-per-host", "8"])
    finally:
        aot.target_devices.cache_clear()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith("jaxmem plan: unsupported version:") and "found jax 0.13.0" in err


def test_host_compute_uses_the_function_form_of_this_jax():
    """The host-side update's entry point: runs fn on the host and leaves outputs where asked."""
    x = jax.device_put(np.arange(6, dtype=np.float32), jax.memory.Space.Host)

    def step(v):
        return compat.host_compute(lambda a: (a * 2, jnp.sum(a)),
                                   (jax.memory.Space.Host, jax.memory.Space.Device))(v)

    doubled, total = jax.jit(step)(x)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(6) * 2)
    assert float(total) == 15.0
    assert doubled.sharding.memory_kind == "pinned_host"


def test_host_compute_refuses_an_unsupported_jax(monkeypatch):
    monkeypatch.setattr(compat.jax, "__version__", "0.9.0")
    with pytest.raises(compat.UnsupportedVersion, match="host-side optimizer update"):
        compat.host_compute(lambda a: a, jax.memory.Space.Host)


def test_cuda_plugin_must_match_jaxlib(monkeypatch):
    versions = {"jaxlib": "0.11.2", "jax-cuda12-plugin": "0.10.2", "jax-cuda13-plugin": None}
    monkeypatch.setattr(compat, "installed_version", versions.get)
    with pytest.raises(compat.UnsupportedVersion, match="jax-cuda12-plugin 0.10.2 does not match jaxlib 0.11.2"):
        compat.require_matching_cuda_plugin()
    versions["jax-cuda12-plugin"] = "0.11.2"
    compat.require_matching_cuda_plugin()  # matching: no error


def test_host_compute_takes_the_jax_011_spelling(monkeypatch):
    """jax 0.11 renamed compute_on2 to compute_on (same keywords, see jax 0.11.2's and 0.12.0.1's
    _src/compute_on.py): with only that spelling present, host_compute calls it. On jax 0.10 the spelling is
    simulated from compute_on2; on 0.11+ it is the installed one, wrapped to see the call."""
    from jax.experimental import compute_on as module

    calls = []
    function_form = getattr(module, "compute_on2", module.compute_on)

    def compute_on(f=None, *, compute_type, out_memory_spaces, compiler_options=None):
        calls.append(compute_type)
        return function_form(f, compute_type=compute_type, out_memory_spaces=out_memory_spaces)

    monkeypatch.setattr(module, "compute_on", compute_on)
    monkeypatch.delattr(module, "compute_on2", raising=False)
    x = jax.device_put(np.ones(4, np.float32), jax.memory.Space.Host)
    out = jax.jit(lambda v: compat.host_compute(lambda a: a + 1, jax.memory.Space.Host)(v))(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.ones(4))
    assert calls == ["device_host"]
