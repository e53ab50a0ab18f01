"""Sequence-parallel attention (DeepSpeed-Ulysses style) around any attention kernel.

Outside attention every activation is split along the sequence over the `sp` mesh axis. Attention needs
whole sequences, so q, k and v are resharded from sequence-split to head-split (one all-to-all each; GSPMD
emits it from the sharding constraints below), the kernel runs on whole sequences and 1/sp of the heads,
and the output goes back to sequence-split (the model's own constraint, one more all-to-all). Segment ids
are gathered whole (int32 [B, T]: small).

Grouped-query attention with fewer kv heads than the head split (kv_heads % (tp * sp) != 0) repeats each
kv head until they split evenly, as Ulysses does: the copies are per device [B, T, heads / (tp * sp), H].
When the query heads themselves do not split over tp * sp, the sequence stays split and k / v are gathered
whole instead (plain XLA attention only; `jaxmem.core.layout.check_sequence_parallel` refuses the fused
kernels there before anything compiles).
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem.mesh.axes import data_axes, head_axes, seq_axis, tp_axis


def head_split(mesh: Mesh) -> int:
    """Devices a sequence-parallel attention splits the heads over: tp x sp."""
    return math.prod(mesh.shape[a] for a in (tp_axis(mesh), seq_axis(mesh)) if a is not None)


def heads_divide(n_heads: int, mesh_sizes: dict[str, int]) -> bool:
    """Whether the query heads split over tp x sp (the all-to-all layout); else kv is gathered whole."""
    return n_heads % (mesh_sizes.get("tp", 1) * mesh_sizes.get("sp", 1)) == 0


def kv_repeats(n_kv_heads: int, ways: int) -> int:
    """How many copies of each kv head make the kv heads split `ways` ways (1 when they already do)."""
    return ways // math.gcd(n_kv_heads, ways)


def sequence_parallel(attention: Callable, mesh: Mesh | None) -> Callable:
    """attention(q, k, v, seg) with q/k/v [B, T, heads, H] split along T over sp, run as described above."""
    if mesh is None or seq_axis(mesh) is None:
        return attention
    data, ways = data_axes(mesh), head_split(mesh)

    def put(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def run(q, k, v, seg, **kwargs):  # kwargs: window, scale (static)
        n, kv = q.shape[2], k.shape[2]
        if n % ways:  # all-gathered kv: queries stay split along the sequence
            whole = P(data, None, None, None)
            return attention(q, put(k, whole), put(v, whole), None if seg is None else put(seg, P(data, None)),
                             **kwargs)
        repeats = kv_repeats(kv, ways)
        if repeats > 1:  # kv * repeats = lcm(kv, ways) divides n: the GQA grouping stays right
            # repeat while still split along the sequence (a local copy), then one all-to-all as for q
            along_seq = P(data, seq_axis(mesh), P.UNCONSTRAINED, None)
            k, v = (put(jnp.repeat(x, repeats, axis=2), along_seq) for x in (k, v))
        spec = P(data, None, head_axes(mesh, k.shape[2]), None)
        q, k, v = put(q, spec), put(k, spec), put(v, spec)
        seg = None if seg is None else put(seg, P(data, None))
        return put(attention(q, k, v, seg, **kwargs), spec)

    return run
