"""The decoder: embedding, a scan over stacked Blocks, final norm, LM head."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmem.config.schema import ModelConfig
from jaxmem.kernels.attention.reference import attention_reference
from jaxmem.kernels.grouped_matmul.reference import grouped_matmul_reference
from jaxmem.kernels.rms_norm.lean import rms_norm_lean
from jaxmem.model import moe as moe_stats
from jaxmem.model.moe import expert_count, is_moe
from jaxmem.mesh.axes import constrain
from jaxmem.model.layers import ACT_BTD, Block, einsum_project, param
from jaxmem.model.rope import inverse_frequencies
from jaxmem.model.seq_tiling import run_whole


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: the embedding lookup (its gradient: a scatter-add into zeros of the table's shape)."""
    return jnp.take(table, ids, axis=0)


@jax.custom_vjp
def take_rows_late_zeros(table: jax.Array, ids: jax.Array) -> jax.Array:
    """take_rows whose gradient makes its [vocab, d] zeros only once the rows' cotangent exists. Made from
    nothing, they are free to be made anywhere: on a mesh XLA's scheduler made them at the end of the loss to
    hide the LM head gradient's reduce-scatter and held them through the layers' backward
    (benchmarks/constants.md, transformer). Same values as take_rows'."""
    return jnp.take(table, ids, axis=0)


def _late_zeros_fwd(table, ids):
    # the residuals are arrays (a pipeline stage returns them): the table's rows and dtype ride on an empty one
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((table.shape[0], 0), table.dtype))


def _late_zeros_bwd(res, g):
    ids, rows = res
    zero, g = jax.lax.optimization_barrier((jnp.zeros((), rows.dtype), g))  # a zero that exists after g
    return jnp.broadcast_to(zero, (rows.shape[0], g.shape[-1])).at[ids].add(g.astype(rows.dtype)), None


take_rows_late_zeros.defvjp(_late_zeros_fwd, _late_zeros_bwd)


def _plain_scan(body, h, stacked_state):
    def step(carry, layer_state):
        return body(carry, layer_state), None

    return jax.lax.scan(step, h, stacked_state)[0]


def _identity_segment(name: str, fn: Callable) -> Callable:
    return fn


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """How the model's ops run; built from config by jaxmem.core.program.build_program, never by the model.

    attention(q, k, v, segment_ids, *, window=None, scale=None) and norm(x, w, eps) pick kernels (a layer
    passes `window`, a static int, only when it is a sliding-window layer, and `scale` only when it is not
    head_dim ** -0.5);
    scan_layers(body, h, stacked_state) owns the layer loop (remat granularity,
    per-layer parameter fetch); segment(name, fn) wraps the attention / MLP parts;
    per_token(fn, *args, names=()) runs a per-token part of a layer (sequence tiling; `per_token_tiled` says
    whether it splits the sequence, so that a mixture of experts returns per-token statistics);
    project(spec, x, w, compute_dtype) multiplies by a layer weight (LoRA dropout: jaxmem.lora.dropout);
    experts(x, weights, experts, expert_weights, ffn, tag) runs a mixture of experts' routed rows
    (jaxmem.model.moe.dispatch_local, or the all-to-all dispatch of jaxmem.moe.expert_parallel);
    grouped_matmul(lhs, rhs, group_sizes, *, preferred_element_type) is the experts' grouped matmul kernel
    (jaxmem.kernels.grouped_matmul; ragged_dot by default);
    grouped(rows, w, group_sizes, compute_dtype, *, kernel) multiplies expert-sorted rows by the experts'
    stacked weight through that kernel (LoRA: jaxmem.lora.linear.grouped_project);
    lookup(table, ids) is the embedding lookup (take_rows, or take_rows_late_zeros on a mesh).
    """

    compute_dtype: Any = jnp.float32
    attention: Callable = lambda q, k, v, seg, **kw: attention_reference(q, k, v, segment_ids_bt=seg, **kw)
    norm: Callable = rms_norm_lean
    scan_layers: Callable = _plain_scan
    segment: Callable = _identity_segment
    per_token: Callable = run_whole
    per_token_tiled: bool = False
    project: Callable = einsum_project
    experts: Callable = moe_stats.dispatch_local
    grouped_matmul: Callable = grouped_matmul_reference
    grouped: Callable = moe_stats.grouped_linear
    lookup: Callable = take_rows


DEFAULT_CONTEXT = ForwardContext()


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), param_dtype)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(key):
            return Block(cfg, param_dtype, nnx.Rngs(params=key))

        self.layers = make_layers(_split_layer_keys(rngs, cfg.n_layers))  # the stream's second key
        self.final_norm = param(rngs, (cfg.d_model,), ("norm",), param_dtype, "ones")
        if not cfg.tie_embeddings:
            self.lm_head = param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), param_dtype)

    def lm_head_weight(self) -> jax.Array:
        """[D, V] output projection (the transposed embedding when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def hidden(self, tokens_bt, ctx: ForwardContext = DEFAULT_CONTEXT, *, segment_ids_bt=None,
               positions_bt=None) -> jax.Array:
        """Final-norm hidden states [B, T, D] in the compute dtype."""
        h = self.embed_tokens(tokens_bt, ctx)
        h = self.run_layers(h, ctx, segment_ids_bt=segment_ids_bt, positions_bt=positions_bt)
        return self.final_hidden(h, ctx)

    # The three parts of `hidden`; a pipeline stage runs the ones it holds (jaxmem.pipeline).
    def embed_tokens(self, tokens_bt, ctx: ForwardContext = DEFAULT_CONTEXT) -> jax.Array:
        """Token embeddings [B, T, D] in the compute dtype."""
        tokens_bt = constrain(tokens_bt, ACT_BTD[:2])
        h = ctx.lookup(self.embed[...], tokens_bt)
        if self.cfg.embed_scale:  # sqrt(d_model) rounded to the weights' dtype first, as transformers does
            h = h * jnp.asarray(self.cfg.d_model ** 0.5, h.dtype)
        return constrain(h.astype(ctx.compute_dtype), ACT_BTD)

    def run_layers(self, h_btd, ctx: ForwardContext = DEFAULT_CONTEXT, *, segment_ids_bt=None,
                   positions_bt=None, router_losses: bool = False, stats_in: dict | None = None,
                   return_stats: bool = False):
        """The decoder layers this module holds, over h [B, T, D]; positions default to 0..T-1 per row.
        With a mixture of experts and `router_losses`: (h, jaxmem.model.moe.router_losses(...));
        a pipeline stage starts from the previous stages' router statistics (`stats_in`) and, with
        `return_stats`, hands (h, statistics) to the next."""
        cfg = self.cfg
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(h_btd.shape[1], dtype=jnp.int32), h_btd.shape[:2])
        positions_bt = constrain(positions_bt, ACT_BTD[:2])
        global_freq, local_freq, mixed = layer_frequencies(cfg)
        graphdef, stacked = nnx.split(self.layers)
        moe = is_moe(cfg)

        def layer(h_btd, layer_state, inv_freq, local=None):
            layer = nnx.merge(graphdef, layer_state)
            attn = ctx.segment("attention", layer.attention_part)
            mlp = ctx.segment("mlp", layer.mlp_part)
            h_btd = attn(h_btd, positions_bt, segment_ids_bt, inv_freq, ctx, local)
            h_btd, stats = mlp(h_btd, ctx) if moe else (mlp(h_btd, ctx), None)
            return constrain(h_btd, ACT_BTD), stats

        # Local and global layers interleave (`mixed`): the scan carries the layer number, and each layer picks
        # its kind from it (one scanned body for both kinds; the window is a static kernel argument per
        # branch). A mixture of experts carries its router statistics. A plain model carries h alone.

        def pack(h, index, stats):
            parts = (h,) + ((index,) if mixed else ()) + ((stats,) if moe else ())
            return parts[0] if len(parts) == 1 else parts

        def unpack(carry):
            if not (mixed or moe):
                return carry, None, None
            rest = list(carry)
            h = rest.pop(0)
            index = rest.pop(0) if mixed else None
            return h, index, rest.pop(0) if moe else None

        def step(carry, layer_state):
            h, index, stats = unpack(carry)
            local, inv_freq = None, global_freq
            if mixed:
                local = (index + 1) % cfg.global_every != 0
                inv_freq = jnp.where(local, local_freq, global_freq)
            h, layer_stats = layer(h, layer_state, inv_freq, local)
            return pack(h, index + 1 if mixed else None, moe_stats.add_stats(stats, layer_stats) if moe else None)

        start = pack(h_btd, jnp.zeros((), jnp.int32) if mixed else None,
                     (moe_stats.zero_stats(expert_count(cfg)) if stats_in is None else stats_in) if moe else None)
        h_btd, _, stats = unpack(ctx.scan_layers(step, start, stacked))
        if return_stats and moe:
            return h_btd, stats
        if router_losses and moe:
            return h_btd, moe_stats.router_losses(stats, expert_count(cfg))
        return h_btd

    def final_hidden(self, h_btd, ctx: ForwardContext = DEFAULT_CONTEXT) -> jax.Array:
        """The final RMSNorm, in the compute dtype."""
        norm = lambda x: ctx.norm(x, self.final_norm[...], self.cfg.norm_eps).astype(ctx.compute_dtype)  # noqa: E731
        return ctx.per_token(norm, h_btd)

    def __call__(self, tokens_bt, ctx: ForwardContext = DEFAULT_CONTEXT, **kwargs) -> jax.Array:
        """Logits [B, T, V] in fp32 (for inference and parity checks; training uses a loss kernel)."""
        h = self.hidden(tokens_bt, ctx, **kwargs)
        w = self.lm_head_weight().astype(ctx.compute_dtype)
        return jnp.einsum("BTD,DV->BTV", h, w, preferred_element_type=jnp.float32)


def layer_frequencies(cfg: ModelConfig):
    """(the global layers' RoPE frequencies, the local layers', whether local and global layers interleave).
    Local layers have their own RoPE base (Gemma 3), else the global layers' frequencies (gpt-oss: YaRN on
    all); where every layer is local both are the local ones."""
    global_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    mixed = bool(cfg.sliding_window and cfg.global_every)
    local_freq = global_freq
    if cfg.sliding_window and cfg.rope_local_theta:
        local_freq = inverse_frequencies(cfg.head_dim, cfg.rope_local_theta)
    if cfg.sliding_window and not mixed:  # every layer local
        global_freq = local_freq
    return global_freq, local_freq, mixed


def init_model(cfg: ModelConfig, *, seed: int = 0, param_dtype=jnp.float32) -> Transformer:
    return Transformer(cfg, param_dtype=param_dtype, rngs=nnx.Rngs(params=seed))


def _split_layer_keys(rngs: nnx.Rngs, n_layers: int) -> jax.Array:
    return jax.random.split(rngs.params(), n_layers)


def layer_keys(cfg: ModelConfig, seed: int) -> jax.Array:
    """[L] keys: init_model(cfg, seed=seed) builds layer i from the i-th (the params stream's second key, split;
    the embedding takes the first)."""
    rngs = nnx.Rngs(params=seed)
    rngs.params()
    return _split_layer_keys(rngs, cfg.n_layers)


def init_layer(cfg: ModelConfig, key: jax.Array, *, param_dtype=jnp.float32) -> dict:
    """One layer's params (a pure dict, no [L] axis) as init_model builds the layer of `key`: a caller that
    turns each layer into something else (a quantized LoRA base) never holds every layer's weights at once."""
    return nnx.to_pure_dict(nnx.split(Block(cfg, param_dtype, nnx.Rngs(params=key)))[1])


def abstract_model(cfg: ModelConfig, *, param_dtype=jnp.float32) -> Transformer:
    """The model with ShapeDtypeStruct leaves: no memory is allocated."""
    return nnx.eval_shape(lambda: init_model(cfg, param_dtype=param_dtype))
