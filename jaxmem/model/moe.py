"""A mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks `experts_per_token` of `n_experts` gated MLPs
per token; dropless, the routed rows run as grouped matmuls (`jax.lax.ragged_dot`).

Routing: softmax over all the router logits (fp32), the top-k probabilities, renormalized to sum to one
when `router_norm_topk` (Mixtral's softmax over its top-k logits is the same numbers). Dispatch: the
token x k assignments sorted by expert (stable), the token rows gathered in that order, one group per
expert (group sizes = tokens routed to it); no token is dropped, so the result does not depend on how
tokens are batched or sharded. Combine: the expert outputs gathered back to assignment order and summed
per token, weighted by the routing weights.

The layer also returns its router statistics (per-expert assignment counts and probability sums, summed
squared logsumexp): they add up over layers and tokens, and `router_losses` turns the totals into the
load-balancing loss as transformers' `load_balancing_loss_func` defines it (the layers' tokens pooled) and
the router z-loss (ST-MoE).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ModelConfig
from jaxmem.config.names import CheckpointName as CN, scope
from jaxmem.model.gated import gated_activation

# logical axes of the expert weights (the expert dim leads; jaxmem.mesh.sharding maps "experts")
EXPERT_DF = ("experts", "embed", "mlp")
EXPERT_FD = ("experts", "mlp", "embed")
ROUTER_DE = ("embed", "experts")


# The model config's keys of a mixture of experts (a Hugging Face family supports them or not).
MOE_FIELDS = ("n_experts", "experts_per_token", "expert_d_ff", "router_norm_topk", "moe_biases",
              "moe_capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")


def is_moe(cfg: ModelConfig) -> bool:
    """Whether the model's MLPs are a mixture of experts."""
    return cfg.n_experts > 0


def expert_count(cfg: ModelConfig) -> int:
    """The experts of each MoE layer (0 for a dense model)."""
    return cfg.n_experts


def with_experts(cfg: ModelConfig, count: int) -> ModelConfig:
    """`cfg` as a mixture of `count` experts."""
    return dataclasses.replace(cfg, n_experts=count)


def expert_width(cfg: ModelConfig) -> int:
    return cfg.expert_d_ff or cfg.d_ff


def init_moe(layer, cfg: ModelConfig, dtype, rngs, *, param, out_std: float) -> None:
    e, d, f = cfg.n_experts, cfg.d_model, expert_width(cfg)
    layer.router = param(rngs, (d, e), ROUTER_DE, dtype)
    layer.expert_gate = param(rngs, (e, d, f), EXPERT_DF, dtype)
    layer.expert_up = param(rngs, (e, d, f), EXPERT_DF, dtype)
    layer.expert_down = param(rngs, (e, f, d), EXPERT_FD, dtype, std=out_std)
    if cfg.moe_biases:  # gpt-oss
        layer.router_bias = param(rngs, (e,), ROUTER_DE[1:], dtype, "zeros")
        layer.expert_gate_bias = param(rngs, (e, f), EXPERT_DF[::2], dtype, "zeros")
        layer.expert_up_bias = param(rngs, (e, f), EXPERT_DF[::2], dtype, "zeros")
        layer.expert_down_bias = param(rngs, (e, d), EXPERT_FD[::2], dtype, "zeros")
    layer.experts_per_token = cfg.experts_per_token
    layer.router_norm_topk = cfg.router_norm_topk
    layer.moe_biases = cfg.moe_biases


def route(logits_ne: jax.Array, k: int, norm_topk: bool):
    """(probs [N, E], weights [N, k], experts [N, k]) from fp32 router logits."""
    probs = jax.nn.softmax(logits_ne.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return probs, weights, experts


def apply_moe(layer, normed_btd, ctx, *, activation: str, tag, token_stats: bool = False):
    """(out [B, T, D], router statistics) for the normed input of one layer. The routed rows run through
    `ctx.experts` (dispatch_local here; jaxmem.moe.expert_parallel over the ep mesh axis). `token_stats`:
    the statistics per token instead, a tuple of [B, T, ...] arrays (TOKEN_STATS order) that
    `sum_token_stats` adds up (a sequence tile returns them)."""
    cd = ctx.compute_dtype
    b, t, d = normed_btd.shape
    k = layer.experts_per_token
    n_experts = layer.router.shape[-1]
    x_nd = normed_btd.reshape(b * t, d)
    with scope(CN.ROUTER_LOGITS):
        logits = jnp.einsum("ND,DE->NE", x_nd, layer.router[...].astype(cd), preferred_element_type=jnp.float32)
        if layer.moe_biases:
            logits = logits + layer.router_bias[...].astype(cd).astype(jnp.float32)
        logits = tag(logits, CN.ROUTER_LOGITS)
    probs, weights, experts = route(logits, k, layer.router_norm_topk)
    linear = lambda lhs, w, group_sizes: ctx.grouped(lhs, w, group_sizes, cd, kernel=ctx.grouped_matmul)  # noqa: E731
    ffn = functools.partial(grouped_mlp, activation=activation, tag=tag, matmul=linear)
    expert_weights = (layer.expert_gate[...], layer.expert_up[...], layer.expert_down[...])
    if layer.moe_biases:
        expert_weights += (layer.expert_gate_bias[...], layer.expert_up_bias[...], layer.expert_down_bias[...])
    out_nd, dropped = ctx.experts(x_nd, weights.astype(cd), experts, expert_weights, ffn, tag)
    with scope(CN.MLP_OUT):
        out = tag(out_nd.reshape(b, t, d), CN.MLP_OUT)
    if token_stats:
        per_token = {"expert_rows": jnp.sum(jax.nn.one_hot(experts, n_experts, dtype=jnp.float32), axis=1),
                     "router_prob": probs, "router_z": jnp.square(jax.nn.logsumexp(logits, axis=-1)),
                     "rows": jnp.ones((b * t,), jnp.float32),
                     "dropped": jnp.zeros((b * t,), jnp.float32).at[0].set(dropped.astype(jnp.float32))}
        return out, tuple(per_token[k].reshape(b, t, *per_token[k].shape[1:]) for k in TOKEN_STATS)
    stats = {"expert_rows": jnp.bincount(experts.reshape(-1), length=n_experts).astype(jnp.float32),  # a count
             "router_prob": jnp.sum(probs, axis=0),
             "router_z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1))),
             "rows": jnp.float32(b * t), "dropped": dropped.astype(jnp.float32)}
    return out, stats


# the router statistics, in the order apply_moe(token_stats=True) returns them per token
TOKEN_STATS = ("expert_rows", "router_prob", "router_z", "rows", "dropped")


def sum_token_stats(per_token) -> dict:
    """The layer's router statistics from per-token ones ([B, T, ...] each, TOKEN_STATS order)."""
    return {k: jnp.sum(v, axis=(0, 1)) for k, v in zip(TOKEN_STATS, per_token, strict=True)}


def grouped_mlp(rows, group_sizes, gate_w, up_w, down_w, *biases, activation: str, tag, matmul):
    """The gated experts over rows grouped by expert (group g: the next group_sizes[g] rows, through weights
    [g]); rows past the groups' total come out zero. `matmul(lhs, w, group_sizes)` multiplies the rows by the
    experts' stacked weight in the compute dtype (ForwardContext.grouped with its grouped-matmul kernel).
    `biases` (gpt-oss): the experts' gate, up and down biases [E, out], each row getting its expert's."""
    expert_of_row = None
    if biases:  # expert index per row; rows past the groups' total get index E, whose bias is zero
        expert_of_row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")

    def grouped(name, lhs, w, b=None):
        with scope(name):
            out = matmul(lhs, w, group_sizes)
            if b is not None:
                b = jnp.concatenate([b, jnp.zeros_like(b[:1])]).astype(out.dtype)
                out = out + jnp.take(b, expert_of_row, axis=0)
            return tag(out, name)

    gate_b, up_b, down_b = biases or (None, None, None)
    gate = cotangent_barrier(grouped(CN.EXPERT_GATE, rows, gate_w, gate_b))
    up = cotangent_barrier(grouped(CN.EXPERT_UP, rows, up_w, up_b))
    with scope(CN.EXPERT_ACT):
        act = tag(gated_activation(activation, gate, up), CN.EXPERT_ACT)
    return grouped(CN.EXPERT_OUT, act, down_w, down_b)


@jax.custom_vjp
def cotangent_barrier(x):
    """x; in the backward its gradient is materialized as it arrives (an optimization barrier). The activation's
    backward then writes d gate and d up once in their dtype: without it XLA fused that elementwise backward
    into the grouped matmul's row gather and kept an fp32 [rows, width] intermediate for it (one per projection
    under the clamped SwiGLU: benchmarks/constants.md, moe)."""
    return x


def _barrier_fwd(x):
    return x, None


def _barrier_bwd(_, g):
    return (jax.lax.optimization_barrier(g),)


cotangent_barrier.defvjp(_barrier_fwd, _barrier_bwd)


def dispatch_local(x_nd, weights_nk, experts_nk, expert_weights, ffn, tag):
    """(out [N, D], dropped assignments = 0): every expert on this device. The assignments sorted by expert
    (stable), the token rows gathered in that order, one group per expert, the outputs gathered back to
    assignment order and summed per token with the routing weights."""
    n, k = experts_nk.shape
    n_experts = expert_weights[0].shape[0]
    flat = experts_nk.reshape(-1)  # assignment a = token * k + slot
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    with scope(CN.MOE_DISPATCH):
        rows = tag(jnp.take(x_nd, order // k, axis=0), CN.MOE_DISPATCH)
    down = ffn(rows, group_sizes, *expert_weights)
    back = jnp.take(down, jnp.argsort(order), axis=0).reshape(n, k, -1)  # assignment order again
    return combine(back, weights_nk), jnp.int32(0)


def combine(back_nkd, weights_nk):
    """Each token's k expert outputs summed with its routing weights."""
    return jnp.einsum("NKD,NK->ND", back_nkd, weights_nk.astype(back_nkd.dtype))


def grouped_linear(rows, w, group_sizes, compute_dtype, *, kernel=jax.lax.ragged_dot):
    """The default `ForwardContext.grouped`: rows [N, in] sorted by expert times that expert's weight of
    w [E, in, out] (group_sizes rows each) in the compute dtype, through the grouped matmul `kernel`
    (ForwardContext.grouped_matmul: jaxmem.kernels.grouped_matmul; LoRA: jaxmem.lora.linear.grouped_project)."""
    return kernel(rows, w.astype(compute_dtype), group_sizes, preferred_element_type=compute_dtype)


def zero_stats(n_experts: int) -> dict:
    """The layer scan's initial router statistics."""
    zeros = jnp.zeros((n_experts,), jnp.float32)
    return {"expert_rows": zeros, "router_prob": zeros, "router_z": jnp.float32(0), "rows": jnp.float32(0),
            "dropped": jnp.float32(0)}


def add_stats(a: dict, b: dict) -> dict:
    return jax.tree.map(jnp.add, a, b)


def router_losses(stats: dict, n_experts: int) -> dict:
    """The load-balancing loss n_experts * sum_e f_e * P_e (f_e: the share of token rows routed to expert e,
    over all k slots; P_e: the mean router probability of e; both over every layer's tokens) and the router
    z-loss (mean over layers and tokens of logsumexp(logits)^2); and the share of the token x top-k assignments
    a capacity-limited dispatch dropped (0 when dropless)."""
    rows = jnp.maximum(stats["rows"], 1.0)
    share = jax.lax.stop_gradient(stats["expert_rows"]) / rows
    aux = n_experts * jnp.sum(share * stats["router_prob"] / rows)
    assignments = jnp.maximum(jnp.sum(jax.lax.stop_gradient(stats["expert_rows"])), 1.0)
    return {"moe_aux_loss": aux, "moe_z_loss": stats["router_z"] / rows,
            "moe_dropped": jax.lax.stop_gradient(stats["dropped"]) / assignments}


# What router_losses returns, the train step's metrics for a mixture of experts.
ROUTER_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped")
