"""The frozen base of a LoRA run and how the layer scan hands its weights to the model.

The train state keeps the adapters under "params" (the only trainable tree: gradients, optimizer state and
master weights exist for it alone) and the base model under "base", never written: every linear of every
layer (all seven projections, adapted or not, as QLoRA defines it; in a mixture of experts the experts'
stacked [E, ...] projections, quantized per layer as one weight, while the small router stays at the parameter
dtype) stored as `lora.base_dtype` (bfloat16, or int8 / nf4 quantized by jaxmem.core.quant), the norms (and
the embedding and LM head unless `lora.quantize_embeddings`) at the parameter dtype. The model itself is built from the base with each
linear replaced by a [L] placeholder; the layer scan carries the stored linears and the adapters per layer
and hands the model a FrozenWeight or an AdaptedWeight (jaxmem.lora.linear) in their place: the projection
computes x W + scale * (x A) B with W dequantized under a custom VJP that keeps only the stored form for the
backward. No merged weight, no weight-shaped gradient, no dequantized layer kept between forward and
backward, under every remat preset (checked on the compiled figures in tests/integration/test_lora_lean.py).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmem.lora.adapters import TARGETS, resolve_targets, scale as lora_scale, target_weights
from jaxmem.core.quant import dequantize, quantize_int8, quantize_nf4
from jaxmem.config.schema import Config
from jaxmem.mesh.sharding import entry_axes
from jaxmem.lora.frozen_vocab import store_table
from jaxmem.model.transformer import init_layer, init_model, layer_keys
from jaxmem.lora.linear import AdaptedWeight, FrozenWeight

NF4_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class LoraSetup:
    targets: tuple[str, ...]  # our layer param names of the adapted linears
    rank: int
    scale: float
    base_dtype: str
    double_quant: bool
    quantize_embeddings: bool = False  # the embedding table and LM head stored as base_dtype too (frozen_vocab)
    # the linears stored as base_dtype: all of them (a mixture of experts: the experts', not the router)
    frozen: tuple[str, ...] = tuple(TARGETS.values())

    @classmethod
    def from_config(cls, cfg: Config) -> "LoraSetup | None":
        lo = cfg.lora
        if lo.rank <= 0:
            return None
        return cls(resolve_targets(lo.targets, model=cfg.model), lo.rank, lora_scale(lo.alpha, lo.rank, lo.rslora),
                   lo.base_dtype, lo.double_quant, lo.quantize_embeddings, tuple(target_weights(cfg.model)))


def _in_dims(cfg: Config, name: str) -> tuple[int, ...]:
    """Per-layer axes of weight `name` that are its inputs (the axes int8 scales reduce over; an expert's
    follow its expert dim)."""
    w = target_weights(cfg.model)[name]
    return tuple(range(len(w.lead_shape), len(w.lead_shape) + len(w.in_shape)))


def store(setup: LoraSetup, cfg: Config, name: str, w: jax.Array):
    """A frozen linear's [L, ...] weight in its stored form."""
    if setup.base_dtype == "int8":
        return quantize_int8(w, tuple(1 + d for d in _in_dims(cfg, name)))
    if setup.base_dtype == "nf4":
        return quantize_nf4(w, NF4_BLOCK, setup.double_quant, batch_dims=1)
    return w.astype(setup.base_dtype)


def unstore(setup: LoraSetup, stored, shape: tuple[int, ...], dtype):
    """One layer's weight of `shape` from its stored form (the layer's slice of every leaf)."""
    return dequantize(setup.base_dtype, stored, shape, dtype)


def store_layers(setup: LoraSetup, cfg: Config, layers: dict, param_dtype) -> dict:
    """Stacked [L, ...] layer params in the base's form: every frozen linear stored, the rest in param_dtype.
    Each layer is stored on its own (quantized per layer), so a slice of layers stores as those layers."""
    out = jax.tree.map(lambda x: x.astype(param_dtype), layers)
    for name in setup.frozen:
        out[name] = store(setup, cfg, name, layers[name])
    return out


def make_base(setup: LoraSetup, cfg: Config, params: dict, param_dtype) -> dict:
    """The frozen base: the model's params in param_dtype, every linear of the layers in its stored form."""
    return dict(_outside_layers(setup, params, param_dtype),
                layers=store_layers(setup, cfg, params["layers"], param_dtype))


def _outside_layers(setup: LoraSetup, params: dict, param_dtype) -> dict:
    """The base's params outside the layers: in param_dtype, or with lora.quantize_embeddings the embedding
    and LM head stored per vocab row ([V, D], the LM head transposed: frozen_vocab)."""
    base = jax.tree.map(lambda x: x.astype(param_dtype), {k: v for k, v in params.items() if k != "layers"})
    if setup.quantize_embeddings:
        for key in ("embed", "lm_head"):
            if key in params:
                base[key] = store_table(setup, key, params[key])
    return base


def base_from_seed(setup: LoraSetup, cfg: Config, seed: int, param_dtype) -> dict:
    """make_base of the model init_model(seed) builds, its layers initialized and stored one at a time (a
    loop over the layer keys). The whole-model init held every layer's weights before storing them, more than
    the step it starts (benchmarks/constants.md, lora); this way it holds none. The values are the
    whole init's (nf4 and bf16 bit for bit; an int8 code may land one step away where XLA fuses the rounding
    product differently: 1 in 180224 in tiny's w_gate on CPU). Call it under jit: the whole model below gives
    the embedding, final norm and LM head; its layers are unused, so XLA does not compute them."""
    model = nnx.to_pure_dict(nnx.split(init_model(cfg.model, seed=seed, param_dtype=param_dtype))[1])
    outside = _outside_layers(setup, model, param_dtype)

    def one_layer(key):
        layer = jax.tree.map(lambda x: x[None], init_layer(cfg.model, key, param_dtype=param_dtype))
        return jax.tree.map(lambda x: x[0], store_layers(setup, cfg, layer, param_dtype))

    return dict(outside, layers=jax.lax.map(one_layer, layer_keys(cfg.model, seed)))


def base_specs(setup: LoraSetup, cfg: Config, model_specs: dict, abstract_base: dict,
               mesh_sizes: dict[str, int]) -> dict:
    """Partition specs of the base: norms (and tables) as the model's params; int8 values as their weight and
    scales without the input dims; nf4 leaves (flattened per layer) split on their last dim like the weight's
    first sharded dim where it divides (mesh_sizes: axis name -> size), else replicated (e.g. the [L, 1]
    offset of double-quantized scales)."""

    def ways(axes) -> int:
        return math.prod(mesh_sizes.get(a, 1) for a in entry_axes(axes))

    layers = dict(model_specs["layers"])
    for name in setup.frozen:
        spec, stored = model_specs["layers"][name], abstract_base["layers"][name]
        if setup.base_dtype == "int8":
            ins = {1 + d for d in _in_dims(cfg, name)}
            layers[name] = {"q": spec, "scale": P(*(None if i in ins else a for i, a in enumerate(spec)))}
        elif setup.base_dtype == "nf4":
            axes = next((a for a in spec if a is not None), None)
            split = lambda x: axes and x.ndim == 2 and x.shape[1] % ways(axes) == 0  # noqa: E731
            layers[name] = jax.tree.map(lambda x: P(None, axes) if split(x) else P(*[None] * x.ndim), stored)
        else:
            layers[name] = spec
    out = dict(model_specs, layers=layers)
    if setup.quantize_embeddings:  # every stored leaf [V, ...]: split on the vocab dim like the table's vocab axis
        for key, vocab_dim in (("embed", 0), ("lm_head", 1)):
            if key in abstract_base:
                axis = (tuple(model_specs[key]) + (None, None))[vocab_dim]
                out[key] = jax.tree.map(lambda x: P(axis, *[None] * (x.ndim - 1)), abstract_base[key])
    return out


def model_params(setup: LoraSetup, base: dict) -> dict:
    """What nnx.merge builds the model from: the base with each frozen linear a [L] placeholder (the layer
    scan hands the model its FrozenWeight / AdaptedWeight per layer)."""
    layers = dict(base["layers"])
    for name in setup.frozen:
        n_layers = jax.tree.leaves(base["layers"][name])[0].shape[0]
        layers[name] = jnp.zeros((n_layers,), jnp.float32)
    vocab = {k: jnp.zeros((), jnp.float32) for k in ("embed", "lm_head") if isinstance(base.get(k), dict)}
    return dict(base, layers=layers, **vocab)  # a stored embedding / head is read by frozen_vocab, not the model


def lora_layers(setup: LoraSetup, base: dict, adapters: dict) -> dict:
    """Per frozen linear, its stored form (and for an adapted one its adapters), all stacked on the layer dim."""
    out = {name: {"stored": base["layers"][name]} for name in setup.frozen}
    for name in setup.targets:
        out[name].update(a=adapters["layers"][name]["a"], b=adapters["layers"][name]["b"])
    return out


def fetch_fn(setup: LoraSetup, shapes: dict[str, tuple[int, ...]], p: float = 0.0) -> Callable:
    """fetch((layer_state, lora_slice)) -> the layer's pure-dict state with each frozen linear a FrozenWeight
    (no adapters) or an AdaptedWeight (jaxmem.lora.linear); `p`: the adapters' input dropout, applied where the
    slice carries keys (the train step's)."""
    def fetch(sliced):
        layer_state, pieces = sliced
        out = nnx.to_pure_dict(layer_state) if isinstance(layer_state, nnx.State) else dict(layer_state)
        for name, piece in pieces.items():
            w = FrozenWeight(piece["stored"], shapes[name], setup.base_dtype)  # stop_gradient inside (linear)
            if "a" in piece:
                key = piece.get("key")
                w = AdaptedWeight(w, piece["a"], piece["b"], key, setup.scale, p if key is not None else 0.0)
            out[name] = w
        return out

    return fetch


def layer_shapes(cfg: Config, setup: LoraSetup) -> dict[str, tuple[int, ...]]:
    """Per-layer shape of each frozen linear."""
    weights = target_weights(cfg.model)
    return {name: weights[name].layer_shape for name in setup.frozen}
