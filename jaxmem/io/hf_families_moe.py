"""The mixture-of-experts Hugging Face families: Mixtral (`MixtralForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`) and gpt-oss (`GptOssForCausalLM`). Mixtral's and Qwen3-MoE's attention is Mistral's /
Qwen3's; every layer's MLP is a router plus `n_experts` gated MLPs, one HF tensor per expert and projection,
stacked here into [experts, ...] arrays (ParamMap names with "{expert}": jaxmem.io.hf_tensors). gpt-oss stores
each layer's experts as stacked tensors already.
"""
from __future__ import annotations

import dataclasses

from jaxmem.io.hf_families import (_LAYER, _LLAMA_OPTIONS, LlamaFamily, Qwen3Family, _cap_at_window, _common,
                                   _hf_common, _hf_rope, _int, _off, _rope, hf_layer_kinds, layer_kinds)
from jaxmem.io.hf_tensors import ParamMap
from jaxmem.config.schema import ConfigError, ModelConfig


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


_GPT_OSS_FIXED = dict(qkv_bias=True, qk_norm=False, post_norms=False, activation="swiglu_clamped", embed_scale=False,
                      query_pre_attn_scalar=0.0, rope_local_theta=0.0, attn_out_bias=True, attention_sinks=True,
                      moe_biases=True, router_norm_topk=True)


@dataclasses.dataclass(frozen=True)
class GptOssFamily(LlamaFamily):
    """gpt-oss (GptOssForCausalLM): q/k/v/o biases, a sink logit per head, local (sliding-window) and global
    layers alternating, YaRN RoPE, and in every layer a router with a bias (softmax over the top-k logits)
    over experts whose gate and up projections are one tensor with interleaved columns (gate even, up odd),
    with biases, through the clamped SwiGLU. Read from bf16 / fp32 tensors, or the Hub's MXFP4 experts
    (jaxmem.io.hf_mxfp4: dequantized as they are read)."""
    architecture: str = "GptOssForCausalLM"
    model_type: str = "gpt_oss"
    options: tuple = tuple(_GPT_OSS_FIXED.items())
    moe: bool = True

    def extra_layer_maps(self, cfg):  # the q/k/v biases come with qkv_bias (LlamaFamily.param_maps)
        return [ParamMap(("layers", "bo"), _LAYER + "self_attn.o_proj.bias", "same"),
                ParamMap(("layers", "sinks"), _LAYER + "self_attn.sinks", "same")]

    def mlp_maps(self, cfg):
        layer, experts = _LAYER, _LAYER + "mlp.experts."
        return [ParamMap(("layers", "router"), layer + "mlp.router.weight", "transpose"),
                ParamMap(("layers", "router_bias"), layer + "mlp.router.bias", "same"),
                ParamMap(("layers", "expert_gate"), experts + "gate_up_proj", "even_cols"),
                ParamMap(("layers", "expert_up"), experts + "gate_up_proj", "odd_cols"),
                ParamMap(("layers", "expert_gate_bias"), experts + "gate_up_proj_bias", "even_cols"),
                ParamMap(("layers", "expert_up_bias"), experts + "gate_up_proj_bias", "odd_cols"),
                ParamMap(("layers", "expert_down"), experts + "down_proj", "same"),
                ParamMap(("layers", "expert_down_bias"), experts + "down_proj_bias", "same")]

    def to_model(self, hf, where):
        quant = hf.get("quantization_config") or {}
        if isinstance(quant, dict) and quant.get("quant_method") not in (None, "mxfp4"):
            raise ConfigError(f"{where}: quantization_config.quant_method={quant['quant_method']!r}: jaxmem reads "
                              "bf16 / fp32 weights and MXFP4 experts (the Hub's gpt-oss); use a dequantized copy")
        if hf.get("attention_bias") is False:
            raise ConfigError(f"{where}: attention_bias=false is not supported for gpt-oss; use true")
        for key, ours in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
            if hf.get(key) is not None and hf[key] != ours:
                raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported; use {ours}")
        theta, scaling = _rope(hf, where)
        fields = _common(hf, where, act_key="hidden_act", acts={"silu": "swiglu_clamped"}, tie_default=False)
        n = _int(hf.get("num_local_experts"), "num_local_experts", where, default=32)
        k = _int(hf.get("num_experts_per_tok", hf.get("experts_per_token")), "num_experts_per_tok", where,
                 default=4)
        _check_k(n, k, where)
        fields.update(_GPT_OSS_FIXED, rope_theta=theta, rope_scaling=scaling, n_experts=n, experts_per_token=k,
                      expert_d_ff=fields["d_ff"], router_aux_loss_coef=_positive_coef(hf, where, 0.9),
                      **layer_kinds(hf, fields["n_layers"], where, default_window=128, default_every=2))
        return ModelConfig(**fields)

    def to_hf(self, cfg, dtype):
        out = _hf_common(cfg, self.architecture, self.model_type, dtype)
        out.update({
            "hidden_act": "silu", "attention_bias": True, "swiglu_limit": 7.0, "rope_theta": cfg.rope_theta,
            "rope_parameters": _hf_rope(cfg.rope_theta, cfg.rope_scaling),
            "intermediate_size": cfg.expert_d_ff or cfg.d_ff, "num_local_experts": cfg.n_experts,
            "num_experts_per_tok": cfg.experts_per_token, "experts_per_token": cfg.experts_per_token,
            **hf_layer_kinds(cfg),
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False})
        return out


MOE_FAMILIES = (MixtralFamily(), Qwen3MoeFamily(), GptOssFamily())
