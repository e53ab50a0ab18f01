"""Published model shapes, by preset name, and their exact parameter counts."""
from __future__ import annotations

import dataclasses

from jaxmem.config.schema import ConfigError, ModelConfig

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, head_dim=128)
_QWEN2 = dict(vocab_size=152064, rope_theta=1000000.0, norm_eps=1e-6, head_dim=128, qkv_bias=True)
# Qwen3 dense (HF Qwen3ForCausalLM config.json): q/k RMSNorm per head, explicit head_dim 128, no biases.
_QWEN3 = dict(vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, head_dim=128, qk_norm=True,
              max_seq_len=40960)
# Gemma 3 text (the text_config of HF Gemma3ForConditionalGeneration): 5 local layers (window 1024, RoPE base
# 10k) then 1 global (RoPE base 1M, linear scaling 8), four (1 + w) norms, q/k norms, GeGLU, tied embeddings
# scaled by sqrt(d_model).
_GEMMA3 = dict(vocab_size=262208, norm_eps=1e-6, qk_norm=True, post_norms=True, activation="gelu_tanh",
               embed_scale=True, tie_embeddings=True, sliding_window=1024, global_every=6, rope_theta=1000000.0,
               rope_local_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0), max_seq_len=131072)

# gpt-oss: q/k/v/o biases, attention sinks, alternating 128-token local and global layers, YaRN RoPE on all of
# them, a clamped SwiGLU in 2880-wide experts with biases (HF config.json of openai/gpt-oss-20b / -120b)
_GPT_OSS = dict(vocab_size=201088, d_model=2880, n_heads=64, n_kv_heads=8, head_dim=64, d_ff=2880, expert_d_ff=2880,
                rope_theta=150000.0, norm_eps=1e-5, qkv_bias=True, attn_out_bias=True, attention_sinks=True,
                activation="swiglu_clamped", sliding_window=128, global_every=2, experts_per_token=4,
                moe_biases=True, max_seq_len=131072,
                rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                  beta_fast=32.0, beta_slow=1.0, truncate=False))

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=352,
                 rope_theta=10000.0, norm_eps=1e-5, max_seq_len=2048),
    "llama3-8b": dict(_LLAMA3, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                      max_seq_len=131072),
    "llama3-70b": dict(_LLAMA3, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                       max_seq_len=131072),
    "llama3.2-1b": dict(_LLAMA3, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192,
                        tie_embeddings=True, max_seq_len=131072,
                        rope_scaling=dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192)),
    "qwen2.5-7b": dict(_QWEN2, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, d_ff=18944,
                       max_seq_len=131072),
    "qwen2-72b": dict(_QWEN2, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=29568,
                      max_seq_len=131072),
    "tiny-qwen3": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=352,
                       rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=2048),
    "tiny-gemma3": dict(_GEMMA3, vocab_size=256, d_model=128, n_layers=7, n_heads=4, n_kv_heads=2, head_dim=32,
                        d_ff=352, query_pre_attn_scalar=32.0, sliding_window=16, max_seq_len=2048),
    "qwen3-8b": dict(_QWEN3, d_model=4096, n_layers=36, n_heads=32, n_kv_heads=8, d_ff=12288),
    "qwen3-32b": dict(_QWEN3, d_model=5120, n_layers=64, n_heads=64, n_kv_heads=8, d_ff=25600),
    "gemma3-12b": dict(_GEMMA3, d_model=3840, n_layers=48, n_heads=16, n_kv_heads=8, head_dim=256, d_ff=15360,
                       query_pre_attn_scalar=256.0),
    "gemma3-27b": dict(_GEMMA3, d_model=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128, d_ff=21504,
                       query_pre_attn_scalar=168.0),
    # Mixtures of experts: every layer's MLP is n_experts gated MLPs of width expert_d_ff (0: d_ff) and a router.
    # Qwen3-30B-A3B (HF Qwen3MoeForCausalLM config.json): 128 experts of width 768, top 8, renormalized.
    "qwen3-30b-a3b": dict(_QWEN3, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, d_ff=6144, n_experts=128,
                          experts_per_token=8, expert_d_ff=768, router_norm_topk=True),
    # Mixtral-8x7B (HF MixtralForCausalLM config.json): Mistral attention, 8 experts of width 14336, top 2.
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         d_ff=14336, rope_theta=1000000.0, norm_eps=1e-5, max_seq_len=32768, n_experts=8,
                         experts_per_token=2),
    "tiny-moe": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=352,
                     rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, max_seq_len=2048, n_experts=8,
                     experts_per_token=2, expert_d_ff=96),
    "gpt-oss-20b": dict(_GPT_OSS, n_layers=24, n_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, n_layers=36, n_experts=128),
    "tiny-gpt-oss": dict(_GPT_OSS, vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                         d_ff=96, expert_d_ff=96, n_experts=8, experts_per_token=2, sliding_window=16,
                         max_seq_len=2048,
                         rope_scaling=dict(_GPT_OSS["rope_scaling"], original_max_position_embeddings=256)),
    "mistral-7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                       d_ff=14336, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=32768),
}

# Published parameter counts (model cards / safetensors index totals).
PUBLISHED_PARAM_COUNTS = {
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2-72b": 72_706_203_648,
    "mistral-7b": 7_241_732_096,
    "qwen3-8b": 8_190_735_360,  # Qwen/Qwen3-8B safetensors index total_size 16381470720 bytes, bf16
    "qwen3-32b": 32_762_123_264,  # Qwen/Qwen3-32B total_size 65524246528 bytes, bf16
    "qwen3-30b-a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B total_size 61064245248 bytes, bf16 (30.5B, 3.3B active)
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1 (46.7B, 12.9B active)
    # the gpt-oss model card (arXiv 2508.10925), table 1: 20.91B total / 3.61B active, 116.83B / 5.13B
    "gpt-oss-20b": 20_914_757_184,
    "gpt-oss-120b": 116_829_156_672,
}
# Parameters one token uses (jaxmem.model.presets.active_param_count), as the model cards round them.
# (gpt-oss's card leaves the input embedding table out of its active count.)
PUBLISHED_ACTIVE_PARAMS_B = {"qwen3-30b-a3b": 3.3, "mixtral-8x7b": 12.9, "gpt-oss-20b": 3.61, "gpt-oss-120b": 5.13}
# The Gemma 3 checkpoints are multimodal (Gemma3ForConditionalGeneration): their published totals include the
# SigLIP vision tower, so the text decoder's count is computed from the text_config sizes instead.
TEXT_DECODER_PARAM_COUNTS = {"gemma3-12b": 11_766_034_176, "gemma3-27b": 27_009_346_304}


def resolve_model(model: ModelConfig, raw: dict) -> ModelConfig:
    """Fills a ModelConfig from its preset; keys given explicitly in `raw` win."""
    if model.preset not in PRESETS and model.preset != "custom":
        raise ConfigError(f"model.preset: {model.preset!r} is unknown; use one of {', '.join(PRESETS)} or custom")
    base = PRESETS.get(model.preset, {})
    values = {k: v for k, v in base.items() if k not in raw}
    return dataclasses.replace(model, **values)


def layer_param_count(m: ModelConfig) -> int:
    """Parameters of one decoder layer: two norms (four with post-norms), q/k/v/o projections (+ biases, + q/k
    norms), gated MLP."""
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    per_layer = 2 * d + d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    if m.n_experts:  # a router and n_experts gated MLPs instead of the dense MLP
        per_layer += d * m.n_experts + 3 * d * (m.expert_d_ff or f) * m.n_experts - 3 * d * f
    if m.qkv_bias:
        per_layer += n * h + 2 * k * h
    if m.attn_out_bias:
        per_layer += d
    if m.attention_sinks:
        per_layer += n
    if m.moe_biases:  # the router's, and each expert's gate, up and down biases
        per_layer += m.n_experts * (1 + 2 * (m.expert_d_ff or f) + d)
    if m.qk_norm:
        per_layer += 2 * h
    if m.post_norms:
        per_layer += 2 * d
    return per_layer


def check_model(m: ModelConfig) -> None:
    """One-line ConfigErrors for the layer-kind keys (jaxmem.config.validate runs it at load)."""
    _check_experts(m)
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window: {m.sliding_window} must be >= 0 (0: no window)")
    if m.global_every < 0 or (m.global_every and not m.sliding_window):
        raise ConfigError(f"model.global_every: {m.global_every} needs model.sliding_window > 0 and must be >= 0")
    if m.query_pre_attn_scalar < 0 or m.rope_local_theta < 0:
        raise ConfigError("model.query_pre_attn_scalar / model.rope_local_theta: must be >= 0 (0: the default)")
    scaling = m.rope_scaling or {}
    if scaling.get("rope_type", "llama3") not in ("llama3", "linear", "yarn"):
        raise ConfigError(f"model.rope_scaling.rope_type: {scaling['rope_type']!r}; use llama3, linear or yarn")
    if scaling and (not isinstance(scaling.get("factor"), (int, float)) or scaling["factor"] <= 0):
        raise ConfigError(f"model.rope_scaling.factor: {scaling.get('factor')!r} must be a positive number")
    if scaling.get("rope_type") == "yarn":
        original = scaling.get("original_max_position_embeddings")
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ConfigError(f"model.rope_scaling.original_max_position_embeddings: {original!r} must be a "
                              "positive int (rope_type yarn)")
        if m.rope_local_theta:  # YaRN's attention factor scales every layer's q and k
            raise ConfigError("model.rope_local_theta: not with rope_scaling.rope_type yarn (its local layers "
                              "use the scaled frequencies); set 0")
    if m.moe_biases and not m.n_experts:
        raise ConfigError("model.moe_biases: needs model.n_experts > 0 (a mixture of experts)")


def _check_experts(m: ModelConfig) -> None:
    if m.n_experts < 0 or m.experts_per_token < 0 or m.expert_d_ff < 0:
        raise ConfigError("model.n_experts / model.experts_per_token / model.expert_d_ff: must be >= 0")
    if m.experts_per_token and not m.n_experts:
        raise ConfigError(f"model.experts_per_token: {m.experts_per_token} needs model.n_experts > 0 (a mixture of "
                          "experts); 0 for a dense MLP")
    if m.n_experts and not 1 <= m.experts_per_token <= m.n_experts:
        raise ConfigError(f"model.experts_per_token: {m.experts_per_token} must be between 1 and model.n_experts="
                          f"{m.n_experts}")
    if m.router_aux_loss_coef < 0 or m.router_z_loss_coef < 0:
        raise ConfigError("model.router_aux_loss_coef / model.router_z_loss_coef: must be >= 0")


def param_count(m: ModelConfig) -> int:
    """Exact parameter count of the decoder described by `m`."""
    embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return embed + m.d_model + m.n_layers * layer_param_count(m)


def active_param_count(m: ModelConfig) -> int:
    """Parameters one token uses: with a mixture of experts, experts_per_token of the n_experts MLPs (the
    router and every other weight count whole); equal to param_count for a dense model."""
    idle = m.n_experts - m.experts_per_token if m.n_experts else 0
    expert = 3 * m.d_model * (m.expert_d_ff or m.d_ff) + (2 * (m.expert_d_ff or m.d_ff) + m.d_model) * m.moe_biases
    return param_count(m) - m.n_layers * idle * expert
