"""The one place that patches jax internals: host memory placement of jit arguments on compile-only devices.

Why: compile-only GPU devices (deviceless AOT compiles) expose no memory spaces,
so `NamedSharding(..., memory_kind="pinned_host")` is canonicalized to the
default kind at construction and host placement of jit arguments and results
vanishes silently. Real devices (GPU, CPU) need no patch: `host_sharding` then
returns an ordinary pinned-host sharding.

How: `host_sharding` returns a fresh sharding object whose identity is recorded.
Two private jax functions are wrapped so that lowering treats exactly
those objects as `pinned_host`: `pxla.are_all_shardings_default_mem_kind` (else
jax drops every memory kind) and `mlir._get_mem_kind` (the per-argument lookup).
The wrapped lowering then writes `mhlo.memory_kind` on those arguments, and XLA
gives them the host memory space (`S(5)` in the entry layout).

Both hooks have the same signature and call sites from jax 0.10.2 through
0.12.0.1 (checked against jax 0.11.2's and 0.12.0.1's source: `lower_jaxpr_to_module`
maps `_get_mem_kind` over the argument and result shardings unless
`are_all_shardings_default_mem_kind` said all are default). Any jax outside
`compat.FEATURES`' range raises `ShimUnsupported` (one line) instead of
guessing. tests/unit/test_shim.py fails loudly if the patch stops putting bytes on
the host.
"""
from __future__ import annotations

import threading

import jax
from jax.sharding import NamedSharding

from jaxmem.runtime import compat

FEATURE = "host offload on compile-only devices (jaxmem.runtime.memory_kinds_shim)"
HOST_KIND = "pinned_host"


class ShimUnsupported(compat.UnsupportedVersion):
    pass


_lock = threading.Lock()
_host_by_id: dict[int, NamedSharding] = {}  # keeps the objects alive, so their ids stay unique
_installed = False


def has_memory_spaces(sharding: NamedSharding) -> bool:
    """Whether the sharding's devices expose memory spaces (real devices do; compile-only ones do not)."""
    device = next(iter(sharding.device_set))
    try:
        return bool(device.addressable_memories())
    except Exception:  # compile-only device objects may not implement the query at all
        return False


def host_sharding(sharding: NamedSharding) -> NamedSharding:
    """The same sharding placed in pinned host memory, also for compile-only devices."""
    if has_memory_spaces(sharding):
        return sharding.with_memory_kind(HOST_KIND)
    install()
    fresh = NamedSharding(sharding.mesh, sharding.spec)
    with _lock:
        _host_by_id[id(fresh)] = fresh
    return fresh


def is_host(sharding) -> bool:
    """True for a sharding that lowers to pinned host memory (either real or via the shim)."""
    if sharding is None:
        return False
    return getattr(sharding, "memory_kind", None) == HOST_KIND or id(sharding) in _host_by_id


def uses_shim(tree) -> bool:
    """Whether any sharding in `tree` is a shim host sharding (compile-only devices)."""
    return any(id(s) in _host_by_id and _host_by_id[id(s)] is s for s in jax.tree.leaves(tree))


def clear_lowering_caches() -> None:
    """jax caches lowerings keyed on sharding equality, which cannot tell a shim host sharding from its
    default twin (measured: compiling the all-device step first made the host-offload step fail with
    "doesn't have correct host memory space color"). Lower shim programs between cleared caches."""
    jax.clear_caches()


def install() -> None:
    """Wraps the two private lowering hooks (idempotent). Raises ShimUnsupported on another jax."""
    global _installed
    if _installed:
        return
    try:
        compat.require(FEATURE)
    except compat.UnsupportedVersion as e:
        raise ShimUnsupported(str(e)) from None
    from jax._src.interpreters import mlir, pxla

    missing = [f"{m.__name__}.{n}" for m, n in ((mlir, "_get_mem_kind"),
                                                  (pxla, "are_all_shardings_default_mem_kind"))
               if not callable(getattr(m, n, None))]
    if missing:
        raise ShimUnsupported(f"jax {jax.__version__} lacks {', '.join(missing)}; update jaxmem.runtime.memory_kinds_shim")
    original_kind = mlir._get_mem_kind
    original_all_default = pxla.are_all_shardings_default_mem_kind

    def get_mem_kind(s):
        if s is not None and id(s) in _host_by_id and _host_by_id[id(s)] is s:
            return HOST_KIND
        kind = original_kind(s)
        # jax drops every kind when one is None; compile-only shardings report None for "device".
        return "device" if kind is None and s is not None and hasattr(s, "memory_kind") else kind

    def all_default(shardings):
        shardings = list(shardings)
        if any(id(s) in _host_by_id and _host_by_id[id(s)] is s for s in shardings):
            return False
        return original_all_default(shardings)

    mlir._get_mem_kind = get_mem_kind
    pxla.are_all_shardings_default_mem_kind = all_default
    _installed = True
