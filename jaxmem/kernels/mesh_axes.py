"""Which mesh axes a kernel's shard_map splits over: rows over the data axes, the sequence over sp, heads
over tp (and sp inside sequence-parallel attention), vocab over tp.

A Pallas or Triton call is opaque to GSPMD, which would all-gather its
operands and run it whole on every device; kernels run per shard instead.
"""
from __future__ import annotations

import math

from jax.sharding import Mesh

from jaxmem.core.sharding import DATA_AXES, TOKEN_AXES, MeshAxis


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
