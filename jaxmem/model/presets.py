"""Published model shapes, by preset name, and their exact parameter counts."""
from __future__ import annotations

import dataclasses

from jaxmem.schema import ConfigError, ModelConfig

_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, head_dim=128)
_QWEN2 = dict(vocab_size=152064, rope_theta=1000000.0, norm_eps=1e-6, head_dim=128, qkv_bias=True)

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
}


def resolve_model(model: ModelConfig, raw: dict) -> ModelConfig:
    """Fills a ModelConfig from its preset; keys given explicitly in `raw` win."""
    if model.preset not in PRESETS and model.preset != "custom":
        raise ConfigError(f"model.preset: {model.preset!r} is unknown; use one of {', '.join(PRESETS)} or custom")
    base = PRESETS.get(model.preset, {})
    values = {k: v for k, v in base.items() if k not in raw}
    return dataclasses.replace(model, **values)


def layer_param_count(m: ModelConfig) -> int:
    """Parameters of one decoder layer: two norms, q/k/v/o projections (+ biases), gated MLP."""
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    per_layer = 2 * d + d * n * h + 2 * d * k * h + n * h * d + 3 * d * f
    if m.qkv_bias:
        per_layer += n * h + 2 * k * h
    return per_layer


def param_count(m: ModelConfig) -> int:
    """Exact parameter count of the decoder described by `m`."""
    embed = m.vocab_size * m.d_model * (1 if m.tie_embeddings else 2)
    return embed + m.d_model + m.n_layers * layer_param_count(m)
