"""LoRA adapter trees: which weights they target, their shapes and logical axes, init, scale and merge.

An adapter tree is a pure dict `{"layers": {param: {"a": A, "b": B}}}`, stacked on the leading layer dim
like the base weights. For a base weight W with input dims `in_shape` and output dims `out_shape` (our
einsum layout, per layer), A is [L, *in_shape, r] and B is [L, r, *out_shape]; the adapted weight is
W + scale * sum_r A[..., r] B[r, ...].
"""
from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ConfigError, ModelConfig

# Hugging Face module name -> our layer param name, in HF checkpoint order.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(frozen=True)
class TargetWeight:
    """One adaptable weight of a decoder layer: its dims and logical axes split into inputs and outputs."""

    param: str  # our layer param name, e.g. "wq"
    hf_module: str  # the HF module path inside a layer, e.g. "self_attn.q_proj"
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_axes: tuple[str, ...]  # logical axis names, as the model's Block declares them
    out_axes: tuple[str, ...]

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)


def target_weights(cfg: ModelConfig) -> dict[str, TargetWeight]:
    """Our param name -> TargetWeight for every adaptable weight of `cfg` (see jaxmem.model.layers.Block)."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    return {w.param: w for w in (
        TargetWeight("wq", "self_attn.q_proj", (d,), (n, h), ("embed",), ("heads", "head_dim")),
        TargetWeight("wk", "self_attn.k_proj", (d,), (k, h), ("embed",), ("kv_heads", "head_dim")),
        TargetWeight("wv", "self_attn.v_proj", (d,), (k, h), ("embed",), ("kv_heads", "head_dim")),
        TargetWeight("wo", "self_attn.o_proj", (n, h), (d,), ("heads", "head_dim"), ("embed",)),
        TargetWeight("w_gate", "mlp.gate_proj", (d,), (f,), ("embed",), ("mlp",)),
        TargetWeight("w_up", "mlp.up_proj", (d,), (f,), ("embed",), ("mlp",)),
        TargetWeight("w_down", "mlp.down_proj", (f,), (d,), ("mlp",), ("embed",)),
    )}


def resolve_targets(names: list[str] | tuple[str, ...] | str, key: str = "lora.targets") -> tuple[str, ...]:
    """HF module names (or "all-linear") -> our param names, in TARGETS order, without duplicates."""
    if isinstance(names, str):
        names = list(TARGETS) if names == ALL_LINEAR else [n.strip() for n in names.split(",") if n.strip()]
    choices = ", ".join([*TARGETS, ALL_LINEAR])
    if not names:
        raise ConfigError(f"{key}: empty; use some of {choices}")
    for name in names:
        if name not in TARGETS:
            raise ConfigError(f"{key}: {name!r} is not a target; use some of {choices}")
    return tuple(ours for hf, ours in TARGETS.items() if hf in names)


def hf_target_names(params: tuple[str, ...]) -> list[str]:
    """Our param names -> their HF module names, in TARGETS order."""
    return [hf for hf, ours in TARGETS.items() if ours in params]


def init_adapters(cfg: ModelConfig, targets: tuple[str, ...], rank: int, key: jax.Array,
                  dtype=jnp.float32) -> dict:
    """A ~ normal(0, 1/fan_in) (scaled by 1/sqrt(fan_in)), B = 0: the adapted model starts as the base model."""
    weights = target_weights(cfg)
    layers = {}
    for param, param_key in zip(targets, jax.random.split(key, len(targets))):
        w = weights[param]
        a = jax.random.normal(param_key, (cfg.n_layers, *w.in_shape, rank), jnp.float32) / math.sqrt(w.in_features)
        layers[param] = {"a": a.astype(dtype), "b": jnp.zeros((cfg.n_layers, rank, *w.out_shape), dtype)}
    return {"layers": layers}


def adapter_axes(targets: tuple[str, ...]) -> dict:
    """Logical axis names per adapter leaf: A keeps the base weight's input axes, B its output axes."""
    weights = target_weights(ModelConfig())  # axes do not depend on sizes
    return {"layers": {p: {"a": ("layers", *weights[p].in_axes, None),
                           "b": ("layers", None, *weights[p].out_axes)} for p in targets}}


def scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """The factor on B @ A: alpha / rank, or alpha / sqrt(rank) for rank-stabilized LoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def lora_delta(a: jax.Array, b: jax.Array, n_out: int) -> jax.Array:
    """sum_r A[..., in..., r] B[..., r, out...] in fp32; leading dims (layers) are batch dims.

    `n_out` is the number of output dims of B (B's trailing dims after the rank).
    """
    n_batch = b.ndim - 1 - n_out
    n_in = a.ndim - 1 - n_batch
    letters = iter(string.ascii_letters.replace("r", ""))
    batch = "".join(next(letters) for _ in range(n_batch))
    ins = "".join(next(letters) for _ in range(n_in))
    outs = "".join(next(letters) for _ in range(n_out))
    return jnp.einsum(f"{batch}{ins}r,{batch}r{outs}->{batch}{ins}{outs}",
                      a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def merge(params: dict, adapters: dict, lora_scale: float) -> dict:
    """`params` with each adapted weight W replaced by W + lora_scale * A B (fp32, cast back to W's dtype).

    Works on the stacked tree (`params["layers"][p]` is [L, ...]) and on one layer's slice alike.
    """
    layers = dict(params["layers"])
    for param, ab in adapters["layers"].items():
        w = layers[param]
        n_out = w.ndim - (ab["a"].ndim - 1)  # W is [*batch, *in, *out]; A is [*batch, *in, r]
        delta = lora_delta(ab["a"], ab["b"], n_out)
        if delta.shape != w.shape:
            raise ValueError(f"adapter for {param}: A B has shape {delta.shape}, the weight {w.shape}")
        layers[param] = (w.astype(jnp.float32) + lora_scale * delta).astype(w.dtype)
    return {**params, "layers": layers}


def adapter_param_count(cfg: ModelConfig, targets: tuple[str, ...], rank: int) -> int:
    """Elements of every A and B over all layers: rank * (in + out features) per adapted weight and layer."""
    weights = target_weights(cfg)
    return cfg.n_layers * rank * sum(weights[p].in_features + weights[p].out_features for p in targets)
