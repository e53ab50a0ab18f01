"""The mixture-of-experts Hugging Face families: Mixtral (`MixtralForCausalLM`) and Qwen3-MoE
(`Qwen3MoeForCausalLM`). Their attention is Mistral's / Qwen3's; every layer's MLP is a router plus
`n_experts` gated MLPs, one HF tensor per expert and projection, stacked here into [experts, ...] arrays
(ParamMap names with "{expert}": jaxmem.io.hf_tensors).
"""
from __future__ import annotations

import dataclasses

from jaxmem.io.hf_families import _LAYER, _LLAMA_OPTIONS, LlamaFamily, Qwen3Family, _cap_at_window, _int, _off
from jaxmem.io.hf_tensors import ParamMap
from jaxmem.config.schema import ConfigError


def _positive_coef(hf: dict, where: str, default: float) -> float:
    value = hf.get("router_aux_loss_coef", default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: router_aux_loss_coef must be a number >= 0, got {value!r}")
    return float(value)


def _expert_maps(prefix: str, router: str, gate: str, up: str, down: str) -> list[ParamMap]:
    experts = _LAYER + prefix + "experts.{expert}."
    return [ParamMap(("layers", "router"), _LAYER + prefix + router, "transpose"),
            ParamMap(("layers", "expert_gate"), experts + gate, "transpose"),
            ParamMap(("layers", "expert_up"), experts + up, "transpose"),
            ParamMap(("layers", "expert_down"), experts + down, "transpose")]


def _check_k(n_experts: int, k: int, where: str) -> None:
    if k > n_experts:
        raise ConfigError(f"{where}: num_experts_per_tok={k} exceeds the {n_experts} experts")


@dataclasses.dataclass(frozen=True)
class MixtralFamily(LlamaFamily):
    """Mixtral: Mistral attention, a sparse MoE block (`block_sparse_moe`: gate + experts w1 / w3 / w2) whose
    routing weights are the softmax over the top-k logits (= the renormalized top-k probabilities)."""
    architecture: str = "MixtralForCausalLM"
    model_type: str = "mixtral"
    options: tuple = tuple(dict(_LLAMA_OPTIONS, router_norm_topk=True).items())
    moe: bool = True

    def mlp_maps(self, cfg):
        return _expert_maps("block_sparse_moe.", "gate.weight", "w1.weight", "w3.weight", "w2.weight")

    def to_model(self, hf, where):
        _off(hf, ("router_jitter_noise",), where)  # training-time noise on the router input: not implemented
        return super().to_model(hf, where)

    def adjust(self, hf, fields, where):
        n = _int(hf.get("num_local_experts"), "num_local_experts", where, default=8)
        k = _int(hf.get("num_experts_per_tok"), "num_experts_per_tok", where, default=2)
        _check_k(n, k, where)
        fields.update(n_experts=n, experts_per_token=k, router_aux_loss_coef=_positive_coef(hf, where, 0.001))
        return _cap_at_window(hf, fields, where, on=True)

    def hf_extras(self, cfg, out):
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   intermediate_size=cfg.expert_d_ff or cfg.d_ff, router_aux_loss_coef=cfg.router_aux_loss_coef,
                   router_jitter_noise=0.0, output_router_logits=False, sliding_window=None)
        return out


@dataclasses.dataclass(frozen=True)
class Qwen3MoeFamily(Qwen3Family):
    """Qwen3-MoE: Qwen3 attention (q/k norms); every layer's MLP a router (`mlp.gate`) and experts of width
    moe_intermediate_size; softmax over all experts, then the top-k, renormalized when norm_topk_prob.
    Layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused."""
    architecture: str = "Qwen3MoeForCausalLM"
    model_type: str = "qwen3_moe"
    moe: bool = True

    def mlp_maps(self, cfg):
        return _expert_maps("mlp.", "gate.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")

    def adjust(self, hf, fields, where):
        fields = super().adjust(hf, fields, where)
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"{where}: mlp_only_layers={hf['mlp_only_layers']!r} is not supported (every layer "
                              "must be a mixture of experts); use []")
        if _int(hf.get("decoder_sparse_step"), "decoder_sparse_step", where, default=1) != 1:
            raise ConfigError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']!r} is not supported; use 1")
        n = _int(hf.get("num_experts", hf.get("num_local_experts")), "num_experts", where, default=128)
        k = _int(hf.get("num_experts_per_tok"), "num_experts_per_tok", where, default=8)
        _check_k(n, k, where)
        norm = hf.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ConfigError(f"{where}: norm_topk_prob must be true or false, got {norm!r}")
        fields.update(n_experts=n, experts_per_token=k, router_norm_topk=norm,
                      expert_d_ff=_int(hf.get("moe_intermediate_size"), "moe_intermediate_size", where),
                      router_aux_loss_coef=_positive_coef(hf, where, 0.001))
        return fields

    def hf_extras(self, cfg, out):
        out = super().hf_extras(cfg, out)
        out.update(num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                   moe_intermediate_size=cfg.expert_d_ff or cfg.d_ff, norm_topk_prob=cfg.router_norm_topk,
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=cfg.router_aux_loss_coef,
                   output_router_logits=False)
        return out


MOE_FAMILIES = (MixtralFamily(), Qwen3MoeFamily())
