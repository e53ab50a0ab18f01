"""Runs a fused loss per shard: tokens split over the data axes and sp, vocab over tp.

A Pallas / Triton call is opaque to GSPMD, which would replicate its operands
(gather [T, D] and [D, V] on every device). Inside shard_map each device runs
the kernel on its own tokens and vocab shard; the online-logsumexp pieces
are combined over tp (pmax, psum) and the global lse goes back into the
local backward, so dh needs one psum over tp and dW one sum over the token axes: a reduce-scatter along D
over the axes the caller keeps the head's gradient split over (FSDP, ZeRO-2/3) where they divide D, a psum
over the rest. Either way dh is released only with the reduced dW, so the kernel's [D, V] partial sum dies before
the layers' backward (XLA had scheduled its reduction late, holding the partial sum through it).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from jaxmem.kernels.cross_entropy.vjp import loss_sum, token_logprobs
from jaxmem.mesh.axes import data_axes, seq_axis, token_axes, tp_axis


def _local_labels(labels_t, v_local: int, tp, ignore_index: int):
    """Labels relative to this vocab shard; a label in another shard becomes v_local (never hit)."""
    if tp is None:
        return labels_t
    offset = jax.lax.axis_index(tp) * v_local
    inside = (labels_t >= offset) & (labels_t < offset + v_local)
    return jnp.where(labels_t == ignore_index, ignore_index, jnp.where(inside, labels_t - offset, v_local))


def _psum_if(x, axes):
    return x if axes is None else jax.lax.psum(x, axes)


def _flat(h, labels):
    return h.reshape(-1, h.shape[-1]), labels.reshape(-1)


def shard_loss(forward, backward, mesh: Mesh, *, ignore_index: int, z_loss: float, dw_axes: tuple | None = None):
    """fn(h, w_dv, labels) -> (loss_sum, n_valid) running `forward`/`backward` per shard.

    h is [T, D] with labels [T] (tokens over the data axes and sp), or [B, T, D] with labels [B, T] (rows
    over the data axes, the sequence over sp: flattening a sequence-split batch of several rows per device
    is not a local reshape, so each shard flattens its own block). forward(h, w, labels) -> (lse, target);
    backward(h, w, labels, lse, g) -> (dh, dw), on [tokens, D] blocks. dw_axes: the axes the caller keeps
    the head's gradient split over along D (possibly none); dW is reduce-scattered over them where they divide
    D and summed over the other token axes. None: the caller does not differentiate the head (a frozen LoRA
    head), so dW is left for XLA to drop.
    """
    tokens, tp = token_axes(mesh), tp_axis(mesh)
    split = tuple(a for a in tokens or () if a in (dw_axes or ()))
    others = tuple(a for a in tokens or () if a not in split) or None

    def forward_body(h, w_dv, labels):
        h_td, labels_t = _flat(h, labels)
        labels_l = _local_labels(labels_t, w_dv.shape[1], tp, ignore_index)
        lse, target = forward(h_td, w_dv, labels_l)
        if tp is not None:
            m = jax.lax.pmax(lse, tp)
            lse = m + jnp.log(jax.lax.psum(jnp.exp(lse - m), tp))
            target = jax.lax.psum(target, tp)
        return _psum_if(loss_sum(lse, target, labels_t, ignore_index, z_loss), tokens), lse.reshape(labels.shape)

    def backward_body(h, w_dv, labels, lse, g):
        h_td, labels_t = _flat(h, labels)
        labels_l = _local_labels(labels_t, w_dv.shape[1], tp, ignore_index)
        dh, dw = backward(h_td, w_dv, labels_l, lse.reshape(-1), g)
        if scattered(w_dv.shape[0]):
            dw = _psum_if(jax.lax.psum_scatter(dw, split, scatter_dimension=0, tiled=True), others)
        else:
            dw = _psum_if(dw, tokens)
        return _psum_if(dh, tp).reshape(h.shape), dw

    def scattered(d_model: int) -> bool:
        return bool(split) and d_model % math.prod(mesh.shape[a] for a in split) == 0

    def sharded(ndim: int):
        # The custom_vjp sits outside shard_map, so no collective is ever transposed by autodiff; check_vma
        # is off because Pallas interpret mode does not track varying axes.
        token_spec = P(tokens) if ndim == 2 else P(data_axes(mesh), seq_axis(mesh))
        rows, cols = P(*token_spec, None), P(None, tp)
        fwd = jax.shard_map(forward_body, mesh=mesh, in_specs=(rows, cols, token_spec),
                            out_specs=(P(), token_spec), check_vma=False)
        return fwd, functools.partial(backward_sharded, rows, cols, token_spec)

    def backward_sharded(rows, cols, token_spec, h, w_dv, labels, lse, g):
        dw_spec = P(split, tp) if scattered(w_dv.shape[0]) else cols
        return jax.shard_map(backward_body, mesh=mesh, in_specs=(rows, cols, token_spec, token_spec, P()),
                             out_specs=(rows, dw_spec), check_vma=False)(h, w_dv, labels, lse, g)

    @jax.custom_vjp
    def global_loss(h, w_dv, labels):
        return sharded(h.ndim)[0](h, w_dv, labels)[0]

    def fwd(h, w_dv, labels):
        loss, lse = sharded(h.ndim)[0](h, w_dv, labels)
        return loss, (h, w_dv, labels, lse)

    def bwd(res, g):
        h, w_dv, labels, lse = res
        dh, dw = sharded(h.ndim)[1](h, w_dv, labels, lse, g)
        if dw_axes is not None:
            # dh is released with the reduced dW: otherwise XLA may schedule dW's reduction after the layers'
            # backward (only the update reads it), keeping the kernel's [D, V] partial sum live through them
            dh, dw = jax.lax.optimization_barrier((dh, dw))
        return dh, dw, None

    global_loss.defvjp(fwd, bwd)

    def loss_fn(h, w_dv, labels):
        return global_loss(h, w_dv, labels), jnp.sum(labels != ignore_index)

    return loss_fn


def shard_token_logprobs(forward, backward, mesh: Mesh, *, ignore_index: int, dw_axes: tuple | None = None):
    """fn(h, w_dv, labels) -> per-token log-probs with labels' shape, running `forward`/`backward` per shard
    like shard_loss (same layouts, same dW reduction); the cotangent is per token, so it stays on the tokens'
    shards, and each shard's backward weighs its tokens by -g."""
    tokens, tp = token_axes(mesh), tp_axis(mesh)
    split = tuple(a for a in tokens or () if a in (dw_axes or ()))
    others = tuple(a for a in tokens or () if a not in split) or None

    def scattered(d_model: int) -> bool:
        return bool(split) and d_model % math.prod(mesh.shape[a] for a in split) == 0

    def forward_body(h, w_dv, labels):
        h_td, labels_t = _flat(h, labels)
        lse, target = forward(h_td, w_dv, _local_labels(labels_t, w_dv.shape[1], tp, ignore_index))
        if tp is not None:
            m = jax.lax.pmax(lse, tp)
            lse = m + jnp.log(jax.lax.psum(jnp.exp(lse - m), tp))
            target = jax.lax.psum(target, tp)
        return token_logprobs(lse, target, labels_t, ignore_index).reshape(labels.shape), lse.reshape(labels.shape)

    def backward_body(h, w_dv, labels, lse, g):
        h_td, labels_t = _flat(h, labels)
        labels_l = _local_labels(labels_t, w_dv.shape[1], tp, ignore_index)
        dh, dw = backward(h_td, w_dv, labels_l, lse.reshape(-1), -g.reshape(-1).astype(jnp.float32))
        if scattered(w_dv.shape[0]):
            dw = _psum_if(jax.lax.psum_scatter(dw, split, scatter_dimension=0, tiled=True), others)
        else:
            dw = _psum_if(dw, tokens)
        return _psum_if(dh, tp).reshape(h.shape), dw

    def specs(ndim: int):
        token_spec = P(tokens) if ndim == 2 else P(data_axes(mesh), seq_axis(mesh))
        return P(*token_spec, None), P(None, tp), token_spec

    @jax.custom_vjp
    def logprobs(h, w_dv, labels):
        return fwd(h, w_dv, labels)[0]

    def fwd(h, w_dv, labels):
        rows, cols, token_spec = specs(h.ndim)
        logp, lse = jax.shard_map(forward_body, mesh=mesh, in_specs=(rows, cols, token_spec),
                                  out_specs=(token_spec, token_spec), check_vma=False)(h, w_dv, labels)
        return logp, (h, w_dv, labels, lse)

    def bwd(res, g):
        h, w_dv, labels, lse = res
        rows, cols, token_spec = specs(h.ndim)
        dw_spec = P(split, tp) if scattered(w_dv.shape[0]) else cols
        dh, dw = jax.shard_map(backward_body, mesh=mesh, in_specs=(rows, cols, token_spec, token_spec, token_spec),
                               out_specs=(rows, dw_spec), check_vma=False)(h, w_dv, labels, lse, g)
        if dw_axes is not None:  # as shard_loss: dh released with the reduced dW
            dh, dw = jax.lax.optimization_barrier((dh, dw))
        return dh, dw, None

    logprobs.defvjp(fwd, bwd)
    return logprobs
