"""Moving arrays between pipeline stages: a plain device-to-device copy when this process drives both
stages, else one collective program over the two stages' devices (a ppermute along a two-slot stage axis),
which both stages' processes call in the same order."""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def owns(mesh: Mesh) -> bool:
    """This process drives (some of) the mesh's devices."""
    me = jax.process_index()
    return any(d.process_index == me for d in mesh.devices.flat)


def leads(mesh: Mesh) -> bool:
    """This process is the lowest-numbered one driving the mesh: it alone reports the mesh's values when they
    are summed over processes (a stage may span several)."""
    return jax.process_index() == min(d.process_index for d in mesh.devices.flat)


def _local_only(a: Mesh, b: Mesh) -> bool:
    me = jax.process_index()
    return all(d.process_index == me for m in (a, b) for d in m.devices.flat)


_PAIR = "pp"


def _pair(src: Mesh, dst: Mesh, spec: P, reverse: bool):
    """(pair mesh, shard_map'd ppermute) moving slot 0 -> 1 (forward) or 1 -> 0 (reverse)."""
    first, second = (dst, src) if reverse else (src, dst)
    mesh = Mesh(np.stack([first.devices, second.devices]), (_PAIR, *first.axis_names),
                axis_types=(jax.sharding.AxisType.Auto,) * (1 + len(first.axis_names)))
    perm = [(1, 0)] if reverse else [(0, 1)]
    full = P(_PAIR, *spec)
    move = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, _PAIR, perm), mesh=mesh, in_specs=full,
                                 out_specs=full))
    return mesh, full, move


class Link:
    """Transfers between two stages' meshes for arrays of one shape, dtype and spec."""

    def __init__(self, src: Mesh, dst: Mesh, shape: tuple, dtype, spec: P, reverse: bool = False):
        self.src, self.dst, self.shape, self.dtype, self.spec = src, dst, tuple(shape), dtype, spec
        self.to = NamedSharding(dst, spec)
        self.local = _local_only(src, dst)
        if not self.local and (owns(src) or owns(dst)):
            self.mesh, self.full, self.move = _pair(src, dst, spec, reverse)
            self.slot = 1 if reverse else 0  # the sender's slot in the pair mesh

    def send(self, x):
        """x (this process's part on the source mesh; None where it drives none of it) -> the array on the
        destination mesh (None in a process that drives none of the destination's devices)."""
        if self.local:
            return jax.device_put(x, self.to)
        if not (owns(self.src) or owns(self.dst)):
            return None
        sharding = NamedSharding(self.mesh, self.full)
        shape = (2, *self.shape)
        index = sharding.addressable_devices_indices_map(shape)
        mine = {s.device: s.data for s in x.addressable_shards} if x is not None else {}
        pieces = []
        for device, idx in index.items():
            if device in mine:  # the sender's slot
                pieces.append(jnp.expand_dims(mine[device], 0))
            else:
                shard = tuple(len(range(*sl.indices(n))) for sl, n in zip(idx, shape))
                pieces.append(jax.device_put(jnp.zeros(shard, self.dtype), device))
        moved = self.move(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
        if not owns(self.dst):
            return None
        dst_devices = set(self.dst.devices.flat)
        shards = [s.data[0] for s in moved.addressable_shards if s.device in dst_devices]
        return jax.make_array_from_single_device_arrays(self.shape, self.to, shards)
