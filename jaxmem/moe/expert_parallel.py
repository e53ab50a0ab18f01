"""Expert parallelism: a mixture of experts' routed rows traded over the ep mesh axis with all-to-alls.

The model calls `ForwardContext.experts` (jaxmem.model.moe.dispatch_local without ep); `dispatcher` builds the
expert-parallel one, a `jax.shard_map` over the whole mesh. Each device routes its own tokens (the batch
rows split over dp x fsdp x ep, the sequence over sp) and holds n_experts / ep experts (the expert dim of
their weights over ep; their other dims all-gathered over the state axes at the shard_map's edge, as ZeRO-3
gathers any weight, and split over tp: each tp device runs a slice of every expert's width and the outputs
are summed over tp).

The dispatch, per device with n tokens, top k, ep peers:
  1. the n x k assignments sorted by expert (stable), so by destination peer (expert // experts per peer);
  2. a send buffer [ep, C, D]: block p holds, in order, the rows routed to peer p's experts, zero-padded,
     with their local expert ids (padding: an id past the last expert);
  3. `jax.lax.all_to_all` over ep: block s of the receive buffer holds peer s's rows for my experts;
  4. the received rows sorted by local expert, grouped matmuls (`jax.lax.ragged_dot`, group sizes counted
     over my experts only; padding rows fall past the groups and come out zero), unsorted;
  5. the reverse all-to-all, each assignment read back from its (peer, slot), combined per token.

Why a padded all-to-all: `jax.lax.ragged_all_to_all` (exact sizes) is not implemented by XLA:CPU in jax
0.10.2 ("ragged-all-to-all is not supported by XLA:CPU ThunkEmitter"), and one code path serves the CPU tests
and the GPU. Its memory cost: dropless (model.moe_capacity_factor = 0, the default) C must hold the worst
case, every token's rows to one peer: C = n x min(k, experts per peer). The send and receive buffers, and the
experts' activations over the received rows (gate, up, act: [ep x C, F]), are then ep x min(k, E/ep) / k
times the rows a device routes, where the single-device layer has n x k; the result does not depend on how
tokens are split. With model.moe_capacity_factor = c > 0, C = ceil(c x n x k / ep): rows past a peer's C are
dropped (their expert output is zero, the token keeps its other experts) and the step's `moe_dropped`
metric is the dropped share of the assignments.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxmem.mesh.axes import TOKEN_AXES, MeshAxis
from jaxmem.model.moe import combine
from jaxmem.config.names import CheckpointName as CN, scope

EP = MeshAxis.EP.value


def capacity(n_tokens: int, k: int, n_experts: int, ep: int, capacity_factor: float) -> int:
    """Rows a device sends each ep peer (the per-peer blocks of its all-to-all buffers)."""
    worst = n_tokens * min(k, n_experts // ep)  # a token routes to k distinct experts
    if capacity_factor <= 0:
        return worst
    return max(1, min(worst, math.ceil(capacity_factor * n_tokens * k / ep)))


def dispatcher(mesh: Mesh, capacity_factor: float = 0.0):
    """The `ForwardContext.experts` function that runs the experts split over the mesh's ep axis."""
    token = tuple(a.value for a in TOKEN_AXES if mesh.shape.get(a.value, 1) > 1) or None
    tp = MeshAxis.TP.value if mesh.shape.get(MeshAxis.TP.value, 1) > 1 else None
    rows_spec = P(token, None)
    weight_specs = (P(EP, None, tp), P(EP, None, tp), P(EP, tp, None))  # gate, up [E, D, F]; down [E, F, D]

    def experts(x_nd, weights_nk, experts_nk, expert_weights, ffn, tag):
        body = functools.partial(_local_experts, ffn=ffn, tag=tag, ep=mesh.shape[EP], tp=tp, token=token,
                                 n_experts=expert_weights[0].shape[0], capacity_factor=capacity_factor)
        return jax.shard_map(body, mesh=mesh, in_specs=(rows_spec, rows_spec, rows_spec, weight_specs),
                             out_specs=(rows_spec, P()))(x_nd, weights_nk, experts_nk, tuple(expert_weights))

    return experts


def _local_experts(x_nd, weights_nk, experts_nk, expert_weights, *, ffn, tag, ep, tp, token, n_experts,
                   capacity_factor):
    """One device's part: (its tokens' combined expert outputs, assignments dropped over the whole mesh)."""
    n, k = experts_nk.shape
    per_peer = n_experts // ep
    cap = capacity(n, k, n_experts, ep, capacity_factor)
    flat = experts_nk.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert_sorted = flat[order]
    peer = expert_sorted // per_peer  # non-decreasing: blocks of consecutive assignments per peer
    per_peer_count = jnp.bincount(peer, length=ep)
    slot = jnp.arange(n * k) - (jnp.cumsum(per_peer_count) - per_peer_count)[peer]
    kept = slot < cap
    dest = jnp.where(kept, peer, ep)  # ep is out of range: the scatter drops the row, the gather reads zero

    send = jnp.zeros((ep, cap, x_nd.shape[-1]), x_nd.dtype).at[dest, slot].set(
        jnp.take(x_nd, order // k, axis=0), mode="drop")
    send_ids = jnp.full((ep, cap), per_peer, jnp.int32).at[dest, slot].set(
        (expert_sorted % per_peer).astype(jnp.int32), mode="drop")
    recv = jax.lax.all_to_all(send, EP, 0, 0).reshape(ep * cap, -1)
    recv_ids = jax.lax.all_to_all(send_ids, EP, 0, 0).reshape(-1)

    by_expert = jnp.argsort(recv_ids, stable=True)  # padding (id per_peer) last
    group_sizes = jnp.bincount(recv_ids, length=per_peer).astype(jnp.int32)  # my experts only
    with scope(CN.MOE_DISPATCH):
        rows = tag(jnp.take(recv, by_expert, axis=0), CN.MOE_DISPATCH)
    out_rows = ffn(rows, group_sizes, *expert_weights)
    back = jnp.take(out_rows, jnp.argsort(by_expert), axis=0).reshape(ep, cap, -1)
    returned = jax.lax.all_to_all(back, EP, 0, 0)
    got = returned.at[dest, slot].get(mode="fill", fill_value=0)  # sorted assignment order
    out = combine(jnp.take(got, jnp.argsort(order), axis=0).reshape(n, k, -1), weights_nk)
    if tp is not None:  # each tp device ran a slice of the experts' width: partial sums
        out = jax.lax.psum(out, tp)
    dropped = jnp.sum(jnp.logical_not(kept)).astype(jnp.int32)
    return out, (jax.lax.psum(dropped, token) if token else dropped)
