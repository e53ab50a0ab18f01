"""A minimal hand-written Llama train step in plain JAX: the speed baseline and an independent reference.

It shares nothing with jaxmem's model code: weights come in as the same pure dict, the math is written
out again here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, head_dim, theta):
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2) / head_dim)
    ang = pos[:, None] * inv[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    a, b = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def forward(p, tokens, *, eps, theta):
    b, t = tokens.shape
    x = p["embed"][tokens]
    pos = jnp.arange(t, dtype=jnp.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))

    def layer(x, w):
        h = _rms(x, w["attn_norm"], eps)
        q = _rope(jnp.einsum("btd,dnh->btnh", h, w["wq"]), pos, w["wq"].shape[-1], theta)
        k = _rope(jnp.einsum("btd,dkh->btkh", h, w["wk"]), pos, w["wk"].shape[-1], theta)
        v = jnp.einsum("btd,dkh->btkh", h, w["wv"])
        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(q.shape[-1])
        a = jax.nn.softmax(jnp.where(causal, s, -1e30), -1)
        x = x + jnp.einsum("bnts,bsnh,nhd->btd", a, v, w["wo"])
        h = _rms(x, w["mlp_norm"], eps)
        return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    x = _rms(x, p["final_norm"], eps)
    return x @ p["lm_head"]


def loss_fn(p, tokens, *, eps, theta):
    logits = forward(p, tokens[:, :-1], eps=eps, theta=theta)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_step(optimizer, *, eps, theta):
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, eps=eps, theta=theta)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
