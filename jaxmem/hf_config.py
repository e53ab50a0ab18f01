"""Hugging Face config.json <-> jaxmem ModelConfig, for Llama, Qwen2 and Mistral checkpoints."""
from __future__ import annotations

import json
import math
from pathlib import Path

from jaxmem.schema import ConfigError, ModelConfig

# architecture -> (model_type, has q/k/v bias)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False),
    "Qwen2ForCausalLM": ("qwen2", True),
    "MistralForCausalLM": ("mistral", False),
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_json_object(path: str | Path) -> dict:
    """The JSON object in `path`; a one-line ConfigError naming the file if it is empty, binary or cut short."""
    data = Path(path).read_bytes()
    if not data.strip():
        raise ConfigError(f"{path}: empty file; expected a JSON object")
    try:
        value = json.loads(data)  # bytes: json detects UTF-8/16/32 itself
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not JSON text ({e.reason} at byte {e.start}); the file is damaged") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                          "the file is damaged or cut short") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def _int(value, name: str, where: str, default: int | None = None) -> int:
    if value is None and default is not None:  # absent or null: the transformers default
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: {name} must be a positive int, got {value!r}")
    return value


def _number(value, name: str, where: str, default: float | None = None) -> float:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use rope_theta + rope_scaling.
    if hf.get("rope_parameters") is not None:
        key, scaling = "rope_parameters", hf["rope_parameters"]
        theta = scaling.get("rope_theta", hf.get("rope_theta")) if isinstance(scaling, dict) else None
    else:
        key, scaling = "rope_scaling", hf.get("rope_scaling")
        theta = hf.get("rope_theta")
    theta = _number(theta, "rope_theta", where, default=10000.0)
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{where}: {key} must be a mapping or null, got {scaling!r}")
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ConfigError(f"{where}: {key}.rope_type={rope_type!r} is not supported; use 'default' or 'llama3'")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{where}: {key}.{missing[0]} is missing (needed for rope_type 'llama3')")
    out = {k: _number(scaling[k], f"{key}.{k}", where) for k in _LLAMA3_KEYS[:3]}
    k = "original_max_position_embeddings"
    out[k] = _int(scaling[k], f"{key}.{k}", where)
    return theta, out


def _sliding_window(hf: dict, arch: str, where: str) -> int | None:
    on = arch == "MistralForCausalLM" or (arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"))
    if not on or hf.get("sliding_window") is None:
        return None
    return _int(hf["sliding_window"], "sliding_window", where)


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Maps a transformers config.json to ModelConfig(preset="custom"); one-line ConfigError otherwise."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(hf).__name__}")
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ConfigError(f"{where}: architectures={archs!r} is not supported; use one of {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    sizes = {key: _int(hf.get(key), key, where) for key in
             ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; use 'silu'")
    for key in ("attention_bias", "mlp_bias"):  # Llama options our layers do not have (o_proj / MLP bias)
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported; use false")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = _int(hf.get("num_key_value_heads"), "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if hf.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                          "set head_dim")
    head_dim = _int(hf.get("head_dim"), "head_dim", where, default=hidden // heads)
    tie = hf.get("tie_word_embeddings")
    tie = False if tie is None else tie
    if not isinstance(tie, bool):  # bool("false") is True: a string here would silently tie the head
        raise ConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    theta, scaling = _rope(hf, where)
    max_seq_len = _int(hf.get("max_position_embeddings"), "max_position_embeddings", where, default=8192)
    window = _sliding_window(hf, arch, where)
    if window:
        # Sliding-window attention equals full causal attention up to the window, and our
        # attention is full causal: cap the sequence length so that stays exact.
        max_seq_len = min(max_seq_len, window)
    return ModelConfig(
        preset="custom", vocab_size=sizes["vocab_size"], d_model=hidden, n_layers=sizes["num_hidden_layers"],
        n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, d_ff=sizes["intermediate_size"], rope_theta=theta,
        rope_scaling=scaling, norm_eps=_number(hf.get("rms_norm_eps"), "rms_norm_eps", where, default=1e-6),
        qkv_bias=ARCHITECTURES[arch][1], tie_embeddings=tie, max_seq_len=max_seq_len)


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
