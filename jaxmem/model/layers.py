"""Transformer block: RMSNorm, GQA attention with RoPE (optional q/k norms, sliding window, sinks), a gated MLP.

Parameters name logical axes (`out_sharding` metadata); activations name theirs
through `constrain`; key tensors carry checkpoint names. Nothing here knows
meshes, remat policies or which kernel implements an op: `ForwardContext` says.
Each tagged value is computed inside `scope(name)` (a jax name scope, only a name), so XLA's op metadata
carries its checkpoint name too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxmem.config.schema import ModelConfig
from jaxmem.mesh.axes import constrain
from jaxmem.config.names import CheckpointName as CN, scope
from jaxmem.model.mlp import MLP_KINDS, mlp_kind
from jaxmem.model.moe import sum_token_stats
from jaxmem.model.rope import apply_rope, attention_factor

from jaxmem.model.mlp import ACT_BTD, ACT_BTF  # noqa: E402,F401  (re-exported: the bill reads them here)

ACT_BTNH = ("act_batch", "act_seq", "act_heads", None)


def param(rngs, shape, axes, dtype, init="normal", std=0.02):
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def einsum_project(spec: str, x, w, compute_dtype):
    """The default `ForwardContext.project`: x times a layer weight w (cast to the compute dtype), by einsum."""
    return jnp.einsum(spec, x, w.astype(compute_dtype))


def tag(x, name: CN):
    """Names `x` for remat policies; compute it inside `with scope(name):` so its ops carry the name too."""
    return checkpoint_name(x, name.value)


class Block(nnx.Module):
    """One decoder layer; `attention_part` and `mlp_part` are separable remat segments.

    Options by config: q/k RMSNorm per head (Qwen3, Gemma 3), post-norms on the attention and MLP outputs
    (Gemma 3: four norms per layer), a custom attention scale, a sliding window on local layers, and the MLP
    kind (jaxmem.model.mlp). Norm weights multiply the normalized input (HF's (1 + w) norms are converted on
    import, jaxmem.io.hf_families)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.attn_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), dtype)
        self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        if cfg.qkv_bias:
            self.bq = param(rngs, (n, h), ("heads", "head_dim"), dtype, "zeros")
            self.bk = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, "zeros")
            self.bv = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, "zeros")
        if cfg.qk_norm:
            self.q_norm = param(rngs, (h,), ("norm",), dtype, "ones")
            self.k_norm = param(rngs, (h,), ("norm",), dtype, "ones")
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype, std=out_std)
        if cfg.attn_out_bias:
            self.bo = param(rngs, (d,), ("embed",), dtype, "zeros")
        if cfg.attention_sinks:  # one logit per q head; gpt-oss trains them, so they start at 0 here
            self.sinks = param(rngs, (n,), ("heads",), dtype, "zeros")
        if cfg.post_norms:
            self.attn_post_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.mlp_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.mlp_kind = mlp_kind(cfg)
        MLP_KINDS[self.mlp_kind].init(self, cfg, dtype, rngs, param=param, out_std=out_std)
        if cfg.post_norms:
            self.mlp_post_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.qkv_bias, self.qk_norm, self.post_norms = cfg.qkv_bias, cfg.qk_norm, cfg.post_norms
        self.attn_out_bias, self.attention_sinks = cfg.attn_out_bias, cfg.attention_sinks
        self.rope_scale = attention_factor(cfg.rope_scaling)
        self.activation = cfg.activation
        self.eps = cfg.norm_eps
        # the attention kernels' default scale is head_dim ** -0.5; pass one only where it differs
        scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        self.attn_scale = None if scale is None or scale == h ** -0.5 else scale
        self.window = cfg.sliding_window or None
        self.global_every = cfg.global_every if cfg.sliding_window else 0

    def attention_part(self, x_btd, positions_bt, segment_ids_bt, inv_freq, ctx, local=None):
        """`local` (a traced bool, with model.global_every) says whether this layer is a sliding-window one."""
        x_btd = tag(x_btd, CN.LAYER_INPUT)  # made by the previous layer (or the embedding): no op here to scope
        project = functools.partial(self.qkv, inv_freq=inv_freq, ctx=ctx)
        q, k, v = ctx.per_token(project, x_btd, positions_bt,
                                names=(CN.QUERY_PROJ.value, CN.KEY_PROJ.value, CN.VALUE_PROJ.value))
        with scope(CN.ATTN_CONTEXT):
            context = tag(constrain(self.attend(q, k, v, segment_ids_bt, local, ctx), ACT_BTNH), CN.ATTN_CONTEXT)
        return ctx.per_token(functools.partial(self.attention_output, ctx=ctx), x_btd, context)

    def attention_part_cached(self, x_btd, positions_bt, inv_freq, ctx, attend):
        """attention_part for generation: `attend(q, k, v, kwargs)` -> (context, what the caller keeps: its
        key/value cache, jaxmem.model.cached) replaces the kernel call; returns (new residual stream, kept)."""
        project = functools.partial(self.qkv, inv_freq=inv_freq, ctx=ctx)
        q, k, v = ctx.per_token(project, x_btd, positions_bt)
        context, kept = attend(q, k, v, self.attention_kwargs())
        return ctx.per_token(functools.partial(self.attention_output, ctx=ctx), x_btd, context), kept

    def attention_kwargs(self) -> dict:
        """The attention kernel's keyword arguments besides the window: a scale where it is not
        head_dim ** -0.5, the sinks where the layer has them."""
        kwargs = {} if self.attn_scale is None else {"scale": self.attn_scale}
        if self.attention_sinks:
            kwargs["sinks"] = self.sinks[...]
        return kwargs

    def attend(self, q, k, v, segment_ids_bt, local, ctx):
        """The attention kernel, with this layer's window: a local layer sees its last `window` keys."""
        kwargs = self.attention_kwargs()
        if self.window is None:
            return ctx.attention(q, k, v, segment_ids_bt, **kwargs)
        windowed = lambda: ctx.attention(q, k, v, segment_ids_bt, window=self.window, **kwargs)  # noqa: E731
        if not self.global_every:
            return windowed()
        # one compiled body for both layer kinds: XLA shares the branches' residual buffers
        return jax.lax.cond(local, windowed, lambda: ctx.attention(q, k, v, segment_ids_bt, **kwargs))

    def qkv(self, x_btd, positions_bt, *, inv_freq, ctx):
        """Per token: RMSNorm, the q/k/v projections (+ biases), the q/k norms and RoPE."""
        cd = ctx.compute_dtype
        with scope(CN.ATTN_NORM):
            normed = tag(ctx.norm(x_btd, self.attn_norm[...], self.eps), CN.ATTN_NORM)
        normed = normed.astype(cd)
        with scope(CN.QUERY_PROJ):
            q = ctx.project("BTD,DNH->BTNH", normed, self.wq[...], cd)
            if self.qkv_bias:
                q = q + self.bq[...].astype(cd)
            q = tag(constrain(q, ACT_BTNH), CN.QUERY_PROJ)
        with scope(CN.KEY_PROJ):
            k = ctx.project("BTD,DKH->BTKH", normed, self.wk[...], cd)
            if self.qkv_bias:
                k = k + self.bk[...].astype(cd)
            k = tag(constrain(k, ACT_BTNH), CN.KEY_PROJ)
        with scope(CN.VALUE_PROJ):
            v = ctx.project("BTD,DKH->BTKH", normed, self.wv[...], cd)
            if self.qkv_bias:
                v = v + self.bv[...].astype(cd)
            v = tag(constrain(v, ACT_BTNH), CN.VALUE_PROJ)
        if self.qk_norm:  # per head over head_dim, before RoPE; recomputed from the saved projections
            q = ctx.norm(q, self.q_norm[...], self.eps).astype(cd)
            k = ctx.norm(k, self.k_norm[...], self.eps).astype(cd)
        rotate = functools.partial(apply_rope, positions_bt=positions_bt, inv_freq=inv_freq, scale=self.rope_scale)
        return rotate(q), rotate(k), v

    def attention_output(self, x_btd, context_btnh, *, ctx):
        """Per token: the output projection, the post-norm (if any) and the residual add."""
        with scope(CN.ATTN_OUT):
            out = ctx.project("BTNH,NHD->BTD", context_btnh, self.wo[...], ctx.compute_dtype)
            if self.attn_out_bias:
                out = out + self.bo[...].astype(ctx.compute_dtype)
            out = tag(constrain(out, ACT_BTD), CN.ATTN_OUT)
        if self.post_norms:
            out = ctx.norm(out, self.attn_post_norm[...], self.eps)
        return x_btd + out.astype(x_btd.dtype)

    def mlp_part(self, x_btd, ctx):
        """The new residual stream; with a mixture of experts (h, router statistics). Under sequence tiling
        (`ctx.per_token_tiled`) a mixture's tiles route their own tokens (dropless routing is per token: the
        same assignments) and return per-token statistics, summed here."""
        if self.mlp_kind != "moe":
            return ctx.per_token(functools.partial(self.mlp, ctx=ctx), x_btd)
        if not ctx.per_token_tiled:
            return self.mlp(x_btd, ctx=ctx)
        h, *per_token = ctx.per_token(functools.partial(self.mlp, ctx=ctx, token_stats=True), x_btd)
        return h, sum_token_stats(per_token)

    def mlp(self, x_btd, *, ctx, token_stats: bool = False):
        """Per token: RMSNorm, the MLP, the post-norm (if any) and the residual add; a mixture of experts adds
        its router statistics (`token_stats`: per token, flat)."""
        with scope(CN.MLP_NORM):
            normed = tag(ctx.norm(x_btd, self.mlp_norm[...], self.eps), CN.MLP_NORM)
        extra = {"token_stats": True} if token_stats else {}
        out = MLP_KINDS[self.mlp_kind].apply(self, normed.astype(ctx.compute_dtype), ctx,
                                             activation=self.activation, tag=tag, **extra)
        out, stats = out if isinstance(out, tuple) else (out, None)
        if self.post_norms:
            out = ctx.norm(out, self.mlp_post_norm[...], self.eps)
        h = x_btd + out.astype(x_btd.dtype)
        if stats is None:
            return h
        return (h, *stats) if token_stats else (h, stats)
