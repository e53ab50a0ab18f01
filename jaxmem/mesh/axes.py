"""The mesh axes by name (outer to inner), the groups of them the step splits data and state over, which of
them a given mesh splits, and the hook through which layers name the logical axes of their activations.

A kernel's shard_map splits rows over the data axes, the sequence over sp, heads over tp (and sp inside
sequence-parallel attention) and vocab over tp: a Pallas or Triton call is opaque to GSPMD, which would
all-gather its operands and run it whole on every device, so kernels run per shard instead. The rule tables
that map logical axes to these mesh axes are jaxmem.mesh.sharding's.
"""
from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from typing import Callable

import jax
from jax.sharding import Mesh


class MeshAxis(enum.StrEnum):
    DP = "dp"
    FSDP = "fsdp"
    EP = "ep"
    SP = "sp"
    TP = "tp"


MESH_AXES = (MeshAxis.DP, MeshAxis.FSDP, MeshAxis.EP, MeshAxis.SP, MeshAxis.TP)
# The batch rows split over these. ep is one of them: outside the experts' matmuls an expert-parallel group
# holds different rows (jaxmem.moe.expert_parallel trades them with all-to-alls for the experts).
DATA_AXES = (MeshAxis.DP, MeshAxis.FSDP, MeshAxis.EP)
# Axes whose devices hold different tokens: gradients are summed over them, and ZeRO shards state over them
# (a sequence-parallel group holds one sequence's tokens, so it shards weights like fsdp does).
TOKEN_AXES = (MeshAxis.DP, MeshAxis.FSDP, MeshAxis.EP, MeshAxis.SP)


def _split(mesh: Mesh, axes) -> tuple[str, ...] | None:
    return tuple(a.value for a in axes if mesh.shape.get(a.value, 1) > 1) or None


def data_axes(mesh: Mesh):
    """The data axes (batch rows) with more than one device, or None."""
    return _split(mesh, DATA_AXES)


def token_axes(mesh: Mesh):
    """The axes that split a flattened [B * T] token dimension (data axes, then sp), or None."""
    return _split(mesh, TOKEN_AXES)


def seq_axis(mesh: Mesh):
    """The sequence-parallel axis name when it has more than one device, else None."""
    return MeshAxis.SP.value if mesh.shape.get(MeshAxis.SP.value, 1) > 1 else None


def tp_axis(mesh: Mesh):
    """The tp axis name when it has more than one device, else None."""
    return MeshAxis.TP.value if mesh.shape.get(MeshAxis.TP.value, 1) > 1 else None


def head_axes(mesh: Mesh, kv_heads: int):
    """The axes attention heads are split over inside a kernel: tp, and sp (Ulysses: sequence-parallel
    attention runs on whole sequences and a slice of the heads), as far as the kv heads divide; or None."""
    axes = []
    for axis in (tp_axis(mesh), seq_axis(mesh)):
        if axis is not None and kv_heads % (mesh.shape[axis] * math.prod(mesh.shape[a] for a in axes)) == 0:
            axes.append(axis)
    return tuple(axes) or None


def is_sharded(mesh: Mesh | None) -> bool:
    return mesh is not None and mesh.size > 1


# A function (x, logical_names) -> x installed by the sharding module while tracing.
_constrainer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("constrainer", default=None)


@contextlib.contextmanager
def activation_rules(fn: Callable[[jax.Array, tuple], jax.Array]):
    token = _constrainer.set(fn)
    try:
        yield
    finally:
        _constrainer.reset(token)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Names the logical axes of an activation; a no-op outside a sharding context."""
    fn = _constrainer.get()
    return x if fn is None else fn(x, names)
