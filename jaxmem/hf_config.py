"""Hugging Face config.json <-> jaxmem ModelConfig, for Llama, Qwen2 and Mistral checkpoints."""
from __future__ import annotations

from jaxmem.config import ConfigError, ModelConfig

# architecture -> (model_type, has q/k/v bias)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "MistralForCausalLM": ("mistral", False),
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use rope_theta + rope_scaling.
    if isinstance(hf.get("rope_parameters"), dict):
        key, scaling = "rope_parameters", hf["rope_parameters"]
        theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:
        key, scaling = "rope_scaling", hf.get("rope_scaling")
        theta = hf.get("rope_theta", 10000.0)
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"{where}: {key}.rope_type={rope_type!r} is not supported; use 'default' or 'llama3'")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{where}: {key}.{missing[0]} is missing (needed for rope_type 'llama3')")
    out = {k: float(scaling[k]) for k in _LLAMA3_KEYS[:3]}
    out["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    return float(theta), out


def _sliding_window(hf: dict, arch: str) -> int | None:
    if arch == "MistralForCausalLM":
        return hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        return hf.get("sliding_window")
    return None


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Maps a transformers config.json to ModelConfig(preset="custom"); one-line ConfigError otherwise."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(f"{where}: architectures={archs!r} is not supported; use one of {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise ConfigError(f"{where}: {key} must be a positive int, got {hf.get(key)!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; use 'silu'")
    for key in ("attention_bias", "mlp_bias"):  # Llama options our layers do not have (o_proj / MLP bias)
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported; use false")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    theta, scaling = _rope(hf, where)
    max_seq_len = int(hf.get("max_position_embeddings") or 8192)
    window = _sliding_window(hf, arch)
    if window:
        # Sliding-window attention equals full causal attention up to the window, and our
        # attention is full causal: cap the sequence length so that stays exact.
        max_seq_len = min(max_seq_len, int(window))
    return ModelConfig(
        preset="custom", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, d_ff=hf["intermediate_size"], rope_theta=theta,
        rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=ARCHITECTURES[arch][1],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), max_seq_len=max_seq_len)


def default_architecture(cfg: ModelConfig) -> str:
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"


def hf_config_from_model(cfg: ModelConfig, dtype: str, architecture: str | None = None) -> dict:
    """The config.json transformers needs to rebuild `cfg` as `architecture`."""
    arch = architecture or default_architecture(cfg)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"architecture: {arch!r} is not supported; use one of {', '.join(ARCHITECTURES)}")
    model_type, qkv_bias = ARCHITECTURES[arch]
    if qkv_bias != cfg.qkv_bias:
        raise ConfigError(f"architecture: {arch} needs model.qkv_bias={qkv_bias}, the model has {cfg.qkv_bias}")
    rope = {"rope_type": "llama3", **cfg.rope_scaling} if cfg.rope_scaling else {"rope_type": "default"}
    out = {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        # rope_parameters for transformers >= 5; rope_theta + rope_scaling for older readers.
        "rope_theta": cfg.rope_theta, "rope_scaling": rope if cfg.rope_scaling else None,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype, "use_cache": True,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:  # our attention is full causal: no sliding window
        out.update(sliding_window=None, use_sliding_window=False)
    return out
