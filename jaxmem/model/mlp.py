"""The MLP of a decoder layer, chosen by config: a gated dense MLP today (SwiGLU or GeGLU).

An MLP kind is a pair of functions on the layer that holds its weights: `init` puts the parameters on the
layer and `apply` maps the normed input [B, T, D] to the MLP output [B, T, D] (before any post-norm and the
residual add). A mixture of experts is another kind: its `init` adds a router and expert-stacked weights,
its `apply` routes the tokens; `mlp_kind` picks it from the model config.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxmem.config.schema import ModelConfig
from jaxmem.mesh.axes import constrain
from jaxmem.model.gated import ACTIVATIONS, gated_activation  # noqa: F401  (ACTIVATIONS re-exported)
from jaxmem.config.names import CheckpointName as CN, scope
from jaxmem.model.moe import apply_moe, init_moe, is_moe

ACT_BTD = ("act_batch", "act_seq", "act_embed")
ACT_BTF = ("act_batch", "act_seq", "act_mlp")


def _init_gated(layer, cfg: ModelConfig, dtype, rngs, *, param, out_std: float) -> None:
    d, f = cfg.d_model, cfg.d_ff
    layer.w_gate = param(rngs, (d, f), ("embed", "mlp"), dtype)
    layer.w_up = param(rngs, (d, f), ("embed", "mlp"), dtype)
    layer.w_down = param(rngs, (f, d), ("mlp", "embed"), dtype, std=out_std)


def _apply_gated(layer, normed_btd, ctx, *, activation: str, tag):
    """down(act(gate(x)) * up(x)); the weights keep the same names in every dense family (HF maps, LoRA)."""
    cd = ctx.compute_dtype
    with scope(CN.MLP_GATE):
        gate = tag(constrain(ctx.project("BTD,DF->BTF", normed_btd, layer.w_gate[...], cd), ACT_BTF), CN.MLP_GATE)
    with scope(CN.MLP_UP):
        up = tag(constrain(ctx.project("BTD,DF->BTF", normed_btd, layer.w_up[...], cd), ACT_BTF), CN.MLP_UP)
    with scope(CN.MLP_ACT):
        act = tag(gated_activation(activation, gate, up), CN.MLP_ACT)  # backward keeps gate, up only
    with scope(CN.MLP_OUT):
        out = ctx.project("BTF,FD->BTD", act, layer.w_down[...], cd)
        return tag(constrain(out, ACT_BTD), CN.MLP_OUT)


@dataclasses.dataclass(frozen=True)
class MLPKind:
    init: Callable  # (layer, cfg, dtype, rngs, *, param, out_std) -> None
    apply: Callable  # (layer, normed_btd, ctx, *, activation, tag) -> out_btd


def _moe_kind() -> MLPKind:
    return MLPKind(init_moe, apply_moe)


# A kind's apply returns the output, or (output, router statistics) for a mixture of experts (moe).
MLP_KINDS: dict[str, MLPKind] = {"gated": MLPKind(_init_gated, _apply_gated), "moe": _moe_kind()}


def mlp_kind(cfg: ModelConfig) -> str:
    """The MLP kind of `cfg`'s layers: a mixture of experts, else the gated MLP."""
    return "moe" if is_moe(cfg) else "gated"
