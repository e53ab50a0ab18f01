"""The JAX versions jaxmem supports, and the one place that knows where their APIs differ.

Everything that touches a private or still-moving JAX API asks `require(feature)` first, so a JAX outside
the range that was checked fails with one line naming the feature and the versions instead of a
traceback from deep inside a lowering.
"""
from __future__ import annotations

import inspect
import re

import jax

# [lowest, first unsupported): 0.10.2 is tested here (Python 3.11); the 0.11 series was checked against
# jax 0.11.2's source, and training ran on it on a GPU (Python 3.12); 0.12.0.1 was checked against its
# source and the suite ran on it on CPU with deviceless GPU compiles (Python 3.12; not yet on a GPU).
JAX_RANGE = ("0.10.2", "0.13")

# Features that reach into JAX internals, with the range each was checked for.
FEATURES = {
    "host offload on compile-only devices (jaxmem.runtime.memory_kinds_shim)": JAX_RANGE,
    "host-side optimizer update (compute_on)": JAX_RANGE,
    "deviceless GPU topologies (jaxmem.runtime.aot)": JAX_RANGE,
    "shard_map varying axes of a value (varying_axes)": JAX_RANGE,
    "FFI handlers for a GPU plugin's host programs (jaxmem.runtime.pjrt_ffi)": JAX_RANGE,
}


class UnsupportedVersion(RuntimeError):
    """A JAX outside the range a feature was checked against; the message is one line."""


def version_tuple(text: str) -> tuple[int, int, int]:
    """'0.11.2' -> (0, 11, 2); extra parts ('0.12.0.1', '0.11.0.dev2025') are ignored."""
    numbers = [int(n) for n in re.findall(r"\d+", text.split("dev")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))


def in_range(version: str, span: tuple[str, str]) -> bool:
    low, high = span
    return version_tuple(low) <= version_tuple(version) < version_tuple(high)


def require(feature: str, version: str | None = None) -> None:
    """Raises UnsupportedVersion unless the running JAX is inside the feature's checked range."""
    version = jax.__version__ if version is None else version
    span = FEATURES[feature]
    if not in_range(version, span):
        raise UnsupportedVersion(f"{feature} supports jax >={span[0]},<{span[1]}; found jax {version} "
                                 f"(install a jax in that range, or run without this feature)")


def host_compute(fn, out_memory_spaces):
    """`fn` compiled to run on the host (XLA host compute), its outputs placed in `out_memory_spaces`.

    jax 0.10 spells this `compute_on2(f, compute_type=, out_memory_spaces=)` (its `compute_on` is a context
    manager); jax 0.11 renamed it to `compute_on` with the same keywords (same signature in 0.12). The
    signature decides, not the version string, so a backport either way keeps working.
    """
    feature = "host-side optimizer update (compute_on)"
    require(feature)
    from jax.experimental import compute_on as module

    api = module.compute_on
    if "out_memory_spaces" not in inspect.signature(api).parameters:
        api = getattr(module, "compute_on2", None)
    if api is None:
        raise UnsupportedVersion(f"{feature}: jax {jax.__version__} has no function form of compute_on")
    return api(fn, compute_type="device_host", out_memory_spaces=out_memory_spaces)


def varying_axes(x) -> frozenset:
    """The manual mesh axes `x` varies over inside a `jax.shard_map` (empty outside one). jax 0.10 to 0.12 keep
    them on the abstract value's `manual_axis_type.varying`; a loop carry built from constants must be cast
    to them (`jax.lax.pcast(..., to="varying")`) to match what the loop body writes."""
    require("shard_map varying axes of a value (varying_axes)")
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", None) or ())


def match_varying(*xs):
    """`xs`, each cast to vary over every manual mesh axis any of them varies over (a no-op outside a
    shard_map). A custom VJP whose inputs vary over different axes would have to return each cotangent at its
    own input's axes; with the inputs matched first, autodiff of the cast sums the cotangents over the axes
    an input did not vary over, as it does for a plain op."""
    axes = frozenset().union(*(varying_axes(x) for x in xs))

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return tuple(cast(x) for x in xs)


def installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def require_matching_cuda_plugin(jaxlib_version: str | None = None) -> None:
    """The CUDA plugin that compiles for GPUs must be built for the running jaxlib (same version)."""
    jaxlib_version = jaxlib_version or installed_version("jaxlib")
    for plugin in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
        found = installed_version(plugin)
        if found is not None and jaxlib_version and version_tuple(found) != version_tuple(jaxlib_version):
            raise UnsupportedVersion(f"{plugin} {found} does not match jaxlib {jaxlib_version}; install "
                                     f"{plugin}=={jaxlib_version} (pip install 'jaxmem[aot]')")
