"""Digests of a train state's arrays: written into a checkpoint's meta at save, checked after every restore.

orbax 0.12 writes array chunks (zstd, OCDBT) without a checksum on the data (only its b-tree and zarr3 shard
indices carry CRC-32C), so bytes flipped inside a data file restore as valid-looking numbers. A digest here
is a function of an array's global values and positions only, never of its sharding or of which process
holds which shard: each element's bits are mixed with its global index (murmur3's 32-bit finalizer) and the
mixed words are summed modulo 2**32, in two differently salted lanes (64 bits in all). Integer addition
modulo 2**32 is exact in any order, so the sum over shards and processes is the same whatever the mesh: a
checkpoint restored onto another mesh, another process count or the host verifies against the digest the
saving run computed.

Arrays in device memory are digested by one jit per device set (an elementwise pass fused into a reduction;
XLA sums across devices and processes). Arrays in host memory (offload.optimizer=host) are digested on the
host, shard by shard (replica 0 only), by the same arithmetic in numpy, and the processes' partial sums are
added. The meta holds a few bytes of JSON per array.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.core.step_state import leaf_name

_GOLDEN = 0x9E3779B1  # odd: a bijection of the running position hash
_SALTS = (0x2545F491, 0x6C8E9CF5)  # one per lane
_HOST_MEMORY = ("pinned_host", "unpinned_host")


def _mix(h, xp):
    """murmur3's fmix32 on uint32 arrays of `xp` (jax.numpy or numpy): every input bit flips about half of the
    output bits."""
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _lanes(words, indices, xp):
    """uint32[2]: the digest sum of `words` whose global index along each dim is `indices[dim]` (broadcastable)."""
    position = xp.zeros(words.shape, xp.uint32)
    for index in indices:  # the global index, folded one dimension at a time (no 32-bit overflow)
        position = _mix(position * xp.uint32(_GOLDEN) + index, xp)
    return xp.stack([xp.sum(_mix(words ^ _mix(position ^ xp.uint32(salt), xp), xp), dtype=xp.uint32)
                     for salt in _SALTS])


def _unsigned(itemsize: int, xp):
    return {1: xp.uint8, 2: xp.uint16, 4: xp.uint32, 8: xp.uint32}[itemsize]


def array_digest(x: jax.Array) -> jax.Array:
    """uint32[2]: the digest of an array in device memory (see the module docstring); traceable."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    words = (x.astype(jnp.uint32) if x.dtype == jnp.bool_  # a 64-bit element becomes a trailing pair of words
             else jax.lax.bitcast_convert_type(x, _unsigned(x.dtype.itemsize, jnp)).astype(jnp.uint32))
    return _lanes(words, [jax.lax.broadcasted_iota(jnp.uint32, words.shape, d) for d in range(words.ndim)], jnp)


def _shard_digest(data: np.ndarray, starts: list[int]) -> np.ndarray:
    """uint32[2]: array_digest's sum over one shard whose first element sits at global index `starts`."""
    if data.dtype == np.bool_:
        words = data.astype(np.uint32)
    else:
        words = np.ascontiguousarray(data).view(_unsigned(data.dtype.itemsize, np)).astype(np.uint32)
        if data.dtype.itemsize == 8:
            words, starts = words.reshape(*data.shape, 2), [*starts, 0]
    indices = [(np.arange(n, dtype=np.uint32) + np.uint32(start)).reshape([-1 if d == dim else 1
                                                                           for d in range(words.ndim)])
               for dim, (n, start) in enumerate(zip(words.shape, starts))]
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps by design
        return _lanes(words, indices, np)


def _host_partial(x: jax.Array) -> np.ndarray:
    """This process's share of a host-memory array's digest: its replica-0 shards."""
    total = np.zeros(2, np.uint32)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            starts = [s.start or 0 for s in shard.index]
            with np.errstate(over="ignore"):
                total = total + _shard_digest(np.asarray(shard.data), starts)
    return total


@jax.jit
def _digests_of(arrays: dict) -> dict:
    return {name: array_digest(x) for name, x in arrays.items()}


def _host_digests(leaves: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """Host-memory arrays, digested on the host; partial sums of arrays that span every process are added
    across processes. An array spread over some processes but not all (a multi-process pipeline's stage) is
    left out: the collective that would add its parts needs every process."""
    me, count = jax.process_index(), jax.process_count()
    spans = {name: {d.process_index for d in x.sharding.device_set} for name, x in leaves.items()}
    local = {name: _host_partial(x) for name, x in sorted(leaves.items()) if spans[name] == {me}}
    shared = sorted(name for name in leaves if len(spans[name]) == count and count > 1)
    if shared:  # every process holds these, in this order
        from jax.experimental import multihost_utils

        parts = multihost_utils.process_allgather(np.stack([_host_partial(leaves[n]) for n in shared]))
        with np.errstate(over="ignore"):
            local.update(zip(shared, np.sum(np.asarray(parts, np.uint32), axis=0, dtype=np.uint32)))
    return local


def _groups(tree) -> tuple[list[dict], dict]:
    """(device-memory leaves by the devices that hold them, in an order every process agrees on: one jit per
    group, a pipeline's stages live on different meshes; host-memory leaves)."""
    groups: dict[tuple, dict] = {}
    host = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        leaf = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
        if getattr(leaf.sharding, "memory_kind", None) in _HOST_MEMORY:
            host[leaf_name(path)] = leaf
            continue
        devices = tuple(sorted(d.id for d in leaf.sharding.device_set))
        groups.setdefault(devices, {})[leaf_name(path)] = leaf
    return [groups[key] for key in sorted(groups)], host


def digests(tree) -> dict[str, str]:
    """'params.layers.wq' -> 'float32:<16 hex digits>' for every array of `tree` (a state, or the part of a
    pipeline's state this process drives). Every process that holds a part must call it (it runs a jit)."""
    groups, host = _groups(tree)
    values = {}
    for group in groups:
        values.update(jax.device_get(_digests_of(group)))
    values.update(_host_digests(host))
    dtypes = {name: x.dtype for group in groups for name, x in group.items()} | {n: x.dtype for n, x in host.items()}
    return {name: f"{dtypes[name]}:{int(v[0]):08x}{int(v[1]):08x}" for name, v in values.items()}


def first_mismatch(saved: dict | None, tree) -> str | None:
    """The first array of `tree` whose digest differs from the one saved; None if all agree. Arrays the save
    did not digest (an older checkpoint) and arrays restored in another dtype (the values were cast) are not
    compared."""
    if not isinstance(saved, dict) or not saved:
        return None
    now = digests(tree)
    for name in sorted(now):
        before = saved.get(name)
        if isinstance(before, str) and before.split(":")[0] == now[name].split(":")[0] and before != now[name]:
            return name
    return None
