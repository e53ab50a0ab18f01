"""Logical-to-mesh rule tables, and the shardings of params and activations (the axis names: jaxmem.mesh.axes).

Rules are ordered (logical, mesh axes)
pairs; a logical dim takes the first rule whose mesh axes are still free in that
tensor's spec and have size > 1 (so one table serves any mesh shape).
"""
from __future__ import annotations

import math
import types
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxmem.config.schema import ConfigError, ParallelConfig
from jaxmem.mesh.axes import DATA_AXES, MESH_AXES, TOKEN_AXES, MeshAxis


_STATE = (MeshAxis.FSDP, MeshAxis.EP, MeshAxis.SP)
_STATE_BUT_EP = (MeshAxis.FSDP, MeshAxis.SP)  # an expert weight's other dims (ep holds its expert dim)
# The expert dim of the experts' weights over ep, at every ZeRO stage; then the state axes as for any weight.
_EXPERTS = [("experts", (MeshAxis.EP,))]


def _state_rules(*logical: str) -> list[tuple[str, tuple]]:
    return [rule for name in logical for rule in ((name, _STATE), (name, _STATE_BUT_EP))]


_ACTIVATIONS = [
    ("act_batch", DATA_AXES),
    ("act_seq", (MeshAxis.SP,)),
    ("act_heads", (MeshAxis.TP,)),
    ("act_kv_heads", (MeshAxis.TP,)),
    ("act_mlp", (MeshAxis.TP,)),
    ("act_vocab", (MeshAxis.TP,)),
]

RULE_TABLES: dict[str, list[tuple[str, tuple]]] = {
    # ZeRO-3 / FSDP: every weight sharded over fsdp along its embed (or vocab) dim.
    "fsdp": _EXPERTS + _state_rules("embed", "vocab", "mlp") + _ACTIVATIONS,
    # Megatron-style TP inside, FSDP across.
    "fsdp_tp": _EXPERTS + [
        ("heads", (MeshAxis.TP,)), ("kv_heads", (MeshAxis.TP,)), ("mlp", (MeshAxis.TP,)),
        ("vocab", (MeshAxis.TP,))] + _state_rules("embed", "vocab") + _ACTIVATIONS,
    # Pure data parallel: weights replicated (TP still applies if tp > 1; experts still split over ep).
    "dp": _EXPERTS + [("heads", (MeshAxis.TP,)), ("kv_heads", (MeshAxis.TP,)), ("mlp", (MeshAxis.TP,)),
                      ("vocab", (MeshAxis.TP,))] + _ACTIVATIONS,
}


def shape_only_mesh(sizes: dict[str, int]):
    """A stand-in mesh of these axis sizes: partition specs only read mesh.shape, so the same specs serve real
    meshes and plans without devices."""
    return types.SimpleNamespace(shape=dict(sizes))


def mesh_shape(par: ParallelConfig, n_devices: int) -> dict[str, int]:
    """dp, fsdp, ep, sp, tp sizes of one pipeline stage's mesh (the whole mesh when parallel.pp = 1)."""
    if n_devices % par.pp:
        raise ConfigError(f"parallel.pp: {par.pp} stages do not divide the {n_devices} devices")
    n_devices //= par.pp
    sizes = {"dp": par.dp, "fsdp": par.fsdp, "ep": par.ep, "sp": par.sp, "tp": par.tp}
    known = math.prod(v for v in sizes.values() if v != -1)
    if n_devices % known:
        raise ConfigError(f"parallel: dp*fsdp*ep*sp*tp={known} does not divide the {n_devices} devices")
    for k, v in sizes.items():
        if v == -1:
            sizes[k] = n_devices // known
    if math.prod(sizes.values()) != n_devices:
        raise ConfigError(f"parallel: dp*fsdp*ep*sp*tp={math.prod(sizes.values())} != {n_devices} devices; "
                          "set one axis to -1 to fill")
    return sizes


def make_mesh(par: ParallelConfig, devices: Sequence | None = None) -> Mesh:
    if par.pp > 1:
        raise ConfigError("parallel.pp: a pipeline runs one program per stage; `jaxmem train` and `jaxmem plan` "
                          "take it (jaxmem.pipeline), this command does not yet: set parallel.pp=1")
    return stage_meshes(par, devices)[0]


def stage_meshes(par: ParallelConfig, devices: Sequence | None = None) -> list[Mesh]:
    """One mesh per pipeline stage over consecutive devices (so with one stage per process, or per node, the
    stage boundaries are the process boundaries); the same dp/fsdp/ep/sp/tp shape in each."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(par, len(devices))
    per = len(devices) // par.pp
    names = tuple(a.value for a in MESH_AXES)
    return [Mesh(np.array(devices[s * per:(s + 1) * per], dtype=object).reshape(tuple(shape[a] for a in MESH_AXES)),
                 names, axis_types=(AxisType.Auto,) * len(MESH_AXES)) for s in range(par.pp)]


def data_ways(mesh: Mesh) -> int:
    return batch_ways(mesh.shape)


def entry_axes(entry) -> tuple:
    """The mesh axis names one partition-spec entry splits its dim over (none for None)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def spec_ways(spec, sizes) -> int:
    """The devices a partition spec splits a value over (their product) for mesh axis sizes by name."""
    return math.prod(sizes[str(a)] for entry in spec for a in entry_axes(entry))


def batch_ways(sizes) -> int:
    """The ways the batch rows are split (dp x fsdp x ep) for mesh axis sizes by name."""
    return math.prod(sizes.get(a.value, 1) for a in DATA_AXES)


def logical_to_spec(names: Sequence[str | None], rules, mesh: Mesh, shape: Sequence[int] | None = None) -> P:
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        chosen = None
        for logical, axes in rules:
            if logical != name:
                continue
            axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
            if not axes or used.intersection(axes):
                continue
            size = math.prod(mesh.shape[a] for a in axes)
            if shape is not None and shape[i] % size:
                continue  # not divisible: try the next rule, else replicate
            chosen = axes
            break
        if chosen:
            used.update(chosen)
            out.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            out.append(None)
    return P(*out)


def without_data_axes(rules):
    """The same table with weights replicated over the token axes dp/fsdp/ep/sp (ZeRO-1/2 parameters); an
    expert weight keeps its expert dim split over ep (each ep device runs its own experts)."""
    out = []
    for logical, axes in rules:
        if logical.startswith("act_") or (logical, axes) in _EXPERTS:
            out.append((logical, axes))
        else:
            out.append((logical, tuple(a for a in axes if a not in TOKEN_AXES)))
    return out


def _is_var(x):
    return isinstance(x, nnx.Variable)


def logical_axes(state: nnx.State) -> dict:
    """Pure-dict tree of each parameter's logical axis names."""
    return nnx.to_pure_dict(jax.tree.map(lambda v: tuple(v.get_metadata()["out_sharding"]), state, is_leaf=_is_var))


def param_specs(state: nnx.State, rules, mesh: Mesh) -> dict:
    axes = logical_axes(state)
    shapes = nnx.to_pure_dict(state)
    return jax.tree.map(lambda names, x: logical_to_spec(names, rules, mesh, x.shape), axes, shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def named(mesh: Mesh, specs, memory_kind: str | None = None):
    return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), specs,
                        is_leaf=lambda x: isinstance(x, P))


def activation_constrainer(rules, mesh: Mesh):
    """The function jaxmem.mesh.axes.activation_rules installs while tracing the step."""

    def constrain(x, names):
        spec = logical_to_spec(names, rules, mesh, x.shape)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return constrain


def batch_spec(mesh: Mesh) -> P:
    axes = tuple(a.value for a in DATA_AXES if mesh.shape[a] > 1)
    return P(axes if axes else None, None)
