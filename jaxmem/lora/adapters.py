"""LoRA adapter trees: which weights they target, their shapes and logical axes, init, scale and merge.

An adapter tree is a pure dict `{"layers": {param: {"a": A, "b": B}}}`, stacked on the leading layer dim
like the base weights. For a base weight W with input dims `in_shape` and output dims `out_shape` (our
einsum layout, per layer), A is [L, *in_shape, r] and B is [L, r, *out_shape]; the adapted weight is
W + scale * sum_r A[..., r] B[r, ...].

In a mixture of experts the MLP names (gate_proj, up_proj, down_proj) target the experts' projections, one
adapter per expert as PEFT puts them (A_e [D, r], B_e [r, F] for expert e): A is [L, E, *in_shape, r] and
B [L, E, r, *out_shape], the expert dim sharded like the experts' weights; the router is never adapted.
"""
from __future__ import annotations

import dataclasses
import math
import string

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ConfigError, ModelConfig
from jaxmem.io.hf_families import _LAYER
from jaxmem.io.hf_families_moe import Qwen3MoeFamily
from jaxmem.io.hf_registry import family_for_config
from jaxmem.model.moe import expert_count, expert_width, is_moe, with_experts

# Hugging Face module name -> our layer param name, in HF checkpoint order.
TARGETS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
           "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}
ALL_LINEAR = "all-linear"
# In a mixture of experts the MLP names adapt the experts' stacked projections (jaxmem.model.moe).
EXPERT_TARGETS = {"gate_proj": "expert_gate", "up_proj": "expert_up", "down_proj": "expert_down"}
DENSE_OF_EXPERT = {expert: TARGETS[hf] for hf, expert in EXPERT_TARGETS.items()}
# Every adaptable param, the order of checkpoints and of PEFT's target_modules (an expert's beside its dense name).
PARAM_ORDER = tuple(p for ours in TARGETS.values() for p in (ours, *[e for e, d in DENSE_OF_EXPERT.items()
                                                                       if d == ours]))


@dataclasses.dataclass(frozen=True)
class TargetWeight:
    """One adaptable weight of a decoder layer: its dims and logical axes split into inputs and outputs."""

    param: str  # our layer param name, e.g. "wq"
    hf_module: str  # the HF module path inside a layer, e.g. "self_attn.q_proj"
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_axes: tuple[str, ...]  # logical axis names, as the model's Block declares them
    out_axes: tuple[str, ...]
    lead_shape: tuple[int, ...] = ()  # per-layer dims before the inputs: (E,) for a mixture's experts
    lead_axes: tuple[str, ...] = ()  # ("experts",) for the experts

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """One layer's weight: [*lead, *in, *out]."""
        return self.lead_shape + self.in_shape + self.out_shape

    @property
    def in_features(self) -> int:
        return math.prod(self.in_shape)

    @property
    def out_features(self) -> int:
        return math.prod(self.out_shape)


def target_weights(cfg: ModelConfig) -> dict[str, TargetWeight]:
    """Our param name -> TargetWeight for every adaptable weight of `cfg` (see jaxmem.model.layers.Block): the
    attention's four and the MLP's three (a mixture of experts: the experts' three, jaxmem.model.moe)."""
    d, n, k, h, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    attention = (
        TargetWeight("wq", "self_attn.q_proj", (d,), (n, h), ("embed",), ("heads", "head_dim")),
        TargetWeight("wk", "self_attn.k_proj", (d,), (k, h), ("embed",), ("kv_heads", "head_dim")),
        TargetWeight("wv", "self_attn.v_proj", (d,), (k, h), ("embed",), ("kv_heads", "head_dim")),
        TargetWeight("wo", "self_attn.o_proj", (n, h), (d,), ("heads", "head_dim"), ("embed",)),
    )
    if is_moe(cfg):
        return {w.param: w for w in (*attention, *_expert_weights(cfg))}
    return {w.param: w for w in (
        *attention,
        TargetWeight("w_gate", "mlp.gate_proj", (d,), (f,), ("embed",), ("mlp",)),
        TargetWeight("w_up", "mlp.up_proj", (d,), (f,), ("embed",), ("mlp",)),
        TargetWeight("w_down", "mlp.down_proj", (f,), (d,), ("mlp",), ("embed",)),
    )}


def _expert_weights(cfg: ModelConfig) -> tuple[TargetWeight, ...]:
    """The experts' three projections; hf_module holds "{expert}" (the family's names: Qwen3-MoE
    mlp.experts.{expert}.gate_proj, Mixtral block_sparse_moe.experts.{expert}.w1)."""
    e, d, f = expert_count(cfg), cfg.d_model, expert_width(cfg)
    modules = expert_modules(cfg)
    return (TargetWeight("expert_gate", modules["expert_gate"], (d,), (f,), ("embed",), ("mlp",), (e,), ("experts",)),
            TargetWeight("expert_up", modules["expert_up"], (d,), (f,), ("embed",), ("mlp",), (e,), ("experts",)),
            TargetWeight("expert_down", modules["expert_down"], (f,), (d,), ("mlp",), ("embed",), (e,), ("experts",)))


def expert_modules(cfg: ModelConfig) -> dict[str, str]:
    """Our expert param name -> its HF module path inside a layer, as the model's family names it (Qwen3-MoE's
    when no family holds the config)."""
    try:
        fam = family_for_config(cfg)
    except ConfigError:
        fam = Qwen3MoeFamily()
    maps = fam.mlp_maps(cfg) if fam.moe else Qwen3MoeFamily().mlp_maps(cfg)
    return {pm.path[1]: pm.hf_name.removeprefix(_LAYER).removesuffix(".weight")
            for pm in maps if pm.path[1] in DENSE_OF_EXPERT}


def model_targets(cfg: ModelConfig | None) -> dict[str, str]:
    """HF module name -> our param name for `cfg`'s model: TARGETS, in a mixture of experts with the MLP names on
    the experts, under gate_proj/up_proj/down_proj and the family's own names (Mixtral: w1/w3/w2)."""
    if cfg is None or not is_moe(cfg):
        return dict(TARGETS)
    out = {hf: EXPERT_TARGETS.get(hf, ours) for hf, ours in TARGETS.items()}
    for ours, module in expert_modules(cfg).items():
        out.setdefault(module.rsplit(".", 1)[-1], ours)
    return out


def resolve_targets(names: list[str] | tuple[str, ...] | str, key: str = "lora.targets",
                    model: ModelConfig | None = None) -> tuple[str, ...]:
    """HF module names (or "all-linear") -> our param names, in TARGETS order, without duplicates; `model` (a
    mixture of experts) puts the MLP names on the experts."""
    allowed = model_targets(model)
    if isinstance(names, str):
        names = list(TARGETS) if names == ALL_LINEAR else [n.strip() for n in names.split(",") if n.strip()]
    choices = ", ".join([*allowed, ALL_LINEAR])
    if not names:
        raise ConfigError(f"{key}: empty; use some of {choices}")
    for name in names:
        if name not in allowed:
            raise ConfigError(f"{key}: {name!r} is not a target; use some of {choices}")
    wanted = {allowed[n] for n in names}
    return tuple(dict.fromkeys(ours for ours in allowed.values() if ours in wanted))


def hf_target_names(params: tuple[str, ...], model: ModelConfig | None = None) -> list[str]:
    """Our param names -> their HF module names (PEFT's target_modules), in TARGETS order; an expert
    projection by its family's name (Mixtral: w1, w3, w2)."""
    names = {ours: hf for hf, ours in TARGETS.items()}
    if model is not None and is_moe(model):
        names.update({ours: module.rsplit(".", 1)[-1] for ours, module in expert_modules(model).items()})
    else:
        names.update({expert: hf for hf, expert in EXPERT_TARGETS.items()})
    return [names[p] for p in PARAM_ORDER if p in params]


def for_model(params: tuple[str, ...], cfg: ModelConfig) -> tuple[str, ...]:
    """`params` with the dense MLP names (w_gate, ...) as the experts' in a mixture of experts."""
    if not is_moe(cfg):
        return params
    to_expert = {dense: expert for expert, dense in DENSE_OF_EXPERT.items()}
    return tuple(dict.fromkeys(to_expert.get(p, p) for p in params))


def init_adapters(cfg: ModelConfig, targets: tuple[str, ...], rank: int, key: jax.Array,
                  dtype=jnp.float32) -> dict:
    """A ~ normal(0, 1/fan_in) (scaled by 1/sqrt(fan_in)), B = 0: the adapted model starts as the base model."""
    weights = target_weights(cfg)
    layers = {}
    for param, param_key in zip(targets, jax.random.split(key, len(targets))):
        w = weights[param]
        lead = (cfg.n_layers, *w.lead_shape)
        a = jax.random.normal(param_key, (*lead, *w.in_shape, rank), jnp.float32) / math.sqrt(w.in_features)
        layers[param] = {"a": a.astype(dtype), "b": jnp.zeros((*lead, rank, *w.out_shape), dtype)}
    return {"layers": layers}


def adapter_axes(targets: tuple[str, ...]) -> dict:
    """Logical axis names per adapter leaf: A keeps the base weight's input axes, B its output axes (an expert's
    both lead with "experts")."""
    weights = {**target_weights(ModelConfig()), **{w.param: w for w in _expert_weights(with_experts(ModelConfig(), 2))}}
    return {"layers": {p: {"a": ("layers", *weights[p].lead_axes, *weights[p].in_axes, None),
                           "b": ("layers", *weights[p].lead_axes, None, *weights[p].out_axes)} for p in targets}}


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
    return cfg.n_layers * rank * sum(math.prod(weights[p].lead_shape) * (weights[p].in_features
                                                                         + weights[p].out_features)
                                     for p in for_model(targets, cfg))
