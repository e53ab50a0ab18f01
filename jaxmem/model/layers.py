"""Transformer block: RMSNorm, GQA attention with RoPE, SwiGLU MLP.

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

from jaxmem.schema import ModelConfig
from jaxmem.model.axes import constrain
from jaxmem.model.names import CheckpointName as CN, scope
from jaxmem.model.rope import apply_rope

ACT_BTD = ("act_batch", "act_seq", "act_embed")
ACT_BTNH = ("act_batch", "act_seq", "act_heads", None)
ACT_BTF = ("act_batch", "act_seq", "act_mlp")


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
    """One decoder layer; `attention_part` and `mlp_part` are separable remat segments."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
        out_std = 0.02 / (2 * cfg.n_layers) ** 0.5
        self.attn_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.wq = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), dtype)
        self.wk = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        self.wv = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), dtype)
        if cfg.qkv_bias:
            self.bq = param(rngs, (n, h), ("heads", "head_dim"), dtype, "zeros")
            self.bk = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, "zeros")
            self.bv = param(rngs, (k, h), ("kv_heads", "head_dim"), dtype, "zeros")
        self.wo = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), dtype, std=out_std)
        self.mlp_norm = param(rngs, (d,), ("norm",), dtype, "ones")
        self.w_gate = param(rngs, (d, f), ("embed", "mlp"), dtype)
        self.w_up = param(rngs, (d, f), ("embed", "mlp"), dtype)
        self.w_down = param(rngs, (f, d), ("mlp", "embed"), dtype, std=out_std)
        self.qkv_bias = cfg.qkv_bias
        self.eps = cfg.norm_eps

    def attention_part(self, x_btd, positions_bt, segment_ids_bt, inv_freq, ctx):
        x_btd = tag(x_btd, CN.LAYER_INPUT)  # made by the previous layer (or the embedding): no op here to scope
        project = functools.partial(self.qkv, inv_freq=inv_freq, ctx=ctx)
        q, k, v = ctx.per_token(project, x_btd, positions_bt,
                                names=(CN.QUERY_PROJ.value, CN.KEY_PROJ.value, CN.VALUE_PROJ.value))
        with scope(CN.ATTN_CONTEXT):
            context = tag(constrain(ctx.attention(q, k, v, segment_ids_bt), ACT_BTNH), CN.ATTN_CONTEXT)
        return ctx.per_token(functools.partial(self.attention_output, ctx=ctx), x_btd, context)

    def qkv(self, x_btd, positions_bt, *, inv_freq, ctx):
        """Per token: RMSNorm, the q/k/v projections (+ biases) and RoPE."""
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
        return apply_rope(q, positions_bt, inv_freq), apply_rope(k, positions_bt, inv_freq), v

    def attention_output(self, x_btd, context_btnh, *, ctx):
        """Per token: the output projection and the residual add."""
        with scope(CN.ATTN_OUT):
            out = ctx.project("BTNH,NHD->BTD", context_btnh, self.wo[...], ctx.compute_dtype)
            out = tag(constrain(out, ACT_BTD), CN.ATTN_OUT)
        return x_btd + out.astype(x_btd.dtype)

    def mlp_part(self, x_btd, ctx):
        return ctx.per_token(functools.partial(self.mlp, ctx=ctx), x_btd)

    def mlp(self, x_btd, *, ctx):
        """Per token: RMSNorm, the SwiGLU MLP and the residual add."""
        cd = ctx.compute_dtype
        with scope(CN.MLP_NORM):
            normed = tag(ctx.norm(x_btd, self.mlp_norm[...], self.eps), CN.MLP_NORM)
        normed = normed.astype(cd)
        with scope(CN.MLP_GATE):
            gate = tag(constrain(ctx.project("BTD,DF->BTF", normed, self.w_gate[...], cd), ACT_BTF),
                       CN.MLP_GATE)
        with scope(CN.MLP_UP):
            up = tag(constrain(ctx.project("BTD,DF->BTF", normed, self.w_up[...], cd), ACT_BTF), CN.MLP_UP)
        with scope(CN.MLP_ACT):
            act = tag(jax.nn.silu(gate) * up, CN.MLP_ACT)
        with scope(CN.MLP_OUT):
            out = ctx.project("BTF,FD->BTD", act, self.w_down[...], cd)
            out = tag(constrain(out, ACT_BTD), CN.MLP_OUT)
        return x_btd + out.astype(x_btd.dtype)
