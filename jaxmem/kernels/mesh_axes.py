"""Which mesh axes a kernel's shard_map splits over: tokens / rows over the data axes, heads / vocab over tp.

A Pallas or Triton call is opaque to GSPMD, which would all-gather its
operands and run it whole on every device; kernels run per shard instead.
"""
from __future__ import annotations

from jax.sharding import Mesh

from jaxmem.sharding import DATA_AXES, MeshAxis


def data_axes(mesh: Mesh):
    """The data axes with more than one device, or None."""
    return tuple(a.value for a in DATA_AXES if mesh.shape.get(a.value, 1) > 1) or None


def tp_axis(mesh: Mesh):
    """The tp axis name when it has more than one device, else None."""
    return MeshAxis.TP.value if mesh.shape.get(MeshAxis.TP.value, 1) > 1 else None


def is_sharded(mesh: Mesh | None) -> bool:
    return mesh is not None and mesh.size > 1
