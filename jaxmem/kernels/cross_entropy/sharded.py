"""Runs a fused loss per shard: tokens split over the data axes, vocab over tp.

A Pallas / Triton call is opaque to GSPMD, which would replicate its operands
(gather [T, D] and [D, V] on every device). Inside shard_map each device runs
the kernel on its own tokens and vocab shard; the online-logsumexp pieces
are combined over tp (pmax, psum) and the global lse goes back into the
local backward, so dh needs one psum over tp and dW one over the data axes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxmem.kernels.cross_entropy.vjp import loss_sum
from jaxmem.kernels.mesh_axes import data_axes, tp_axis


def _local_labels(labels_t, v_local: int, tp, ignore_index: int):
    """Labels relative to this vocab shard; a label in another shard becomes v_local (never hit)."""
    if tp is None:
        return labels_t
    offset = jax.lax.axis_index(tp) * v_local
    inside = (labels_t >= offset) & (labels_t < offset + v_local)
    return jnp.where(labels_t == ignore_index, ignore_index, jnp.where(inside, labels_t - offset, v_local))


def shard_loss(forward, backward, mesh: Mesh, *, ignore_index: int, z_loss: float):
    """fn(h_td, w_dv, labels_t) -> (loss_sum, n_valid) running `forward`/`backward` per shard.

    forward(h, w, labels) -> (lse, target); backward(h, w, labels, lse, g) -> (dh, dw).
    """
    data, tp = data_axes(mesh), tp_axis(mesh)

    def psum_if(x, axes):
        return x if axes is None else jax.lax.psum(x, axes)

    def stats(h_td, w_dv, labels_t):
        labels_l = _local_labels(labels_t, w_dv.shape[1], tp, ignore_index)
        lse, target = forward(h_td, w_dv, labels_l)
        if tp is not None:
            m = jax.lax.pmax(lse, tp)
            lse = m + jnp.log(jax.lax.psum(jnp.exp(lse - m), tp))
            target = jax.lax.psum(target, tp)
        return labels_l, lse, target

    def forward_body(h_td, w_dv, labels_t):
        _, lse, target = stats(h_td, w_dv, labels_t)
        return psum_if(loss_sum(lse, target, labels_t, ignore_index, z_loss), data), lse

    def backward_body(h_td, w_dv, labels_t, lse, g):
        labels_l = _local_labels(labels_t, w_dv.shape[1], tp, ignore_index)
        dh, dw = backward(h_td, w_dv, labels_l, lse, g)
        return psum_if(dh, tp), psum_if(dw, data)

    # The custom_vjp sits outside shard_map, so no collective is ever transposed by autodiff; check_vma is off
    # because Pallas interpret mode does not track varying axes.
    rows, cols = P(data, None), P(None, tp)
    forward_sharded = jax.shard_map(forward_body, mesh=mesh, in_specs=(rows, cols, P(data)),
                                    out_specs=(P(), P(data)), check_vma=False)
    backward_sharded = jax.shard_map(backward_body, mesh=mesh, in_specs=(rows, cols, P(data), P(data), P()),
                                     out_specs=(rows, cols), check_vma=False)

    @jax.custom_vjp
    def global_loss(h_td, w_dv, labels_t):
        return forward_sharded(h_td, w_dv, labels_t)[0]

    def fwd(h_td, w_dv, labels_t):
        loss, lse = forward_sharded(h_td, w_dv, labels_t)
        return loss, (h_td, w_dv, labels_t, lse)

    def bwd(res, g):
        h_td, w_dv, labels_t, lse = res
        dh, dw = backward_sharded(h_td, w_dv, labels_t, lse, g)
        return dh, dw, None

    global_loss.defvjp(fwd, bwd)

    def loss_fn(h_td, w_dv, labels_t):
        return global_loss(h_td, w_dv, labels_t), jnp.sum(labels_t != ignore_index)

    return loss_fn
