"""One adapter per Hugging Face model family: its tensor names, its config.json translation and its weight
transforms (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text; Mixtral and Qwen3-MoE in jaxmem.io.hf_families_moe).

An adapter says which jaxmem parameter each HF tensor holds (`param_maps`), reads a config.json into a
ModelConfig (`to_model`) and writes one back (`to_hf`). The registry by architecture name, and
`family_for_config` (the adapter that can express a ModelConfig), live in jaxmem.io.hf_registry: a new family
is a new adapter here, registered there.
"""
from __future__ import annotations

import dataclasses
import math

from jaxmem.io.hf_tensors import ParamMap
from jaxmem.config.schema import ConfigError, ModelConfig
from jaxmem.model.moe import is_moe

_LAYER = "model.layers.{layer}."
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# ---------------------------------------------------------------- config.json fields


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


def _rope_scaling(scaling, key: str, where: str) -> dict | None:
    """A rope_scaling / rope_parameters mapping -> our rope_scaling (llama3 or linear), or None for default."""
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{where}: {key} must be a mapping or null, got {scaling!r}")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": _number(scaling.get("factor"), f"{key}.factor", where)}
    if rope_type == "yarn":
        return _yarn_scaling(scaling, key, where)
    if rope_type != "llama3":
        raise ConfigError(f"{where}: {key}.rope_type={rope_type!r} is not supported; use 'default', 'linear', "
                          "'llama3' or 'yarn'")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"{where}: {key}.{missing[0]} is missing (needed for rope_type 'llama3')")
    out = {k: _number(scaling[k], f"{key}.{k}", where) for k in _LLAMA3_KEYS[:3]}
    k = "original_max_position_embeddings"
    out[k] = _int(scaling[k], f"{key}.{k}", where)
    return out


def _yarn_scaling(scaling: dict, key: str, where: str) -> dict:
    for k in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of the attention factor
        if scaling.get(k):
            raise ConfigError(f"{where}: {key}.{k}={scaling[k]!r} is not supported; use null")
    k = "original_max_position_embeddings"
    out = {"rope_type": "yarn", "factor": _number(scaling.get("factor"), f"{key}.factor", where),
           k: _int(scaling.get(k), f"{key}.{k}", where),
           "beta_fast": _number(scaling.get("beta_fast"), f"{key}.beta_fast", where, default=32.0),
           "beta_slow": _number(scaling.get("beta_slow"), f"{key}.beta_slow", where, default=1.0)}
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{where}: {key}.truncate must be true or false, got {truncate!r}")
    out["truncate"] = truncate
    if scaling.get("attention_factor") is not None:
        out["attention_factor"] = _number(scaling["attention_factor"], f"{key}.attention_factor", where)
    return out


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files use rope_theta + rope_scaling.
    if hf.get("rope_parameters") is not None:
        key, scaling = "rope_parameters", hf["rope_parameters"]
        theta = scaling.get("rope_theta", hf.get("rope_theta")) if isinstance(scaling, dict) else None
    else:
        key, scaling = "rope_scaling", hf.get("rope_scaling")
        theta = hf.get("rope_theta")
    scaling = _rope_scaling(scaling, key, where)
    return _number(theta, "rope_theta", where, default=10000.0), scaling


def _hf_rope(theta: float, scaling: dict | None) -> dict:
    """rope_parameters as transformers >= 5 writes them."""
    if not scaling:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": scaling.get("rope_type", "llama3"), **scaling, "rope_theta": theta}


def _off(hf: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:  # options our layers do not have
        if hf.get(key):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported; use false / null")


def _common(hf: dict, where: str, *, act_key: str, acts: dict[str, str], tie_default: bool) -> dict:
    """The ModelConfig fields every family spells the same way."""
    sizes = {key: _int(hf.get(key), key, where) for key in
             ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    act = hf.get(act_key, next(iter(acts)))
    if act not in acts:
        raise ConfigError(f"{where}: {act_key}={act!r} is not supported; use {' or '.join(map(repr, acts))}")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    kv_heads = _int(hf.get("num_key_value_heads"), "num_key_value_heads", where, default=heads)
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
    if hf.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}; "
                          "set head_dim")
    tie = hf.get("tie_word_embeddings")
    tie = tie_default if tie is None else tie
    if not isinstance(tie, bool):  # bool("false") is True: a string here would silently tie the head
        raise ConfigError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    return dict(
        preset="custom", vocab_size=sizes["vocab_size"], d_model=hidden, n_layers=sizes["num_hidden_layers"],
        n_heads=heads, n_kv_heads=kv_heads, head_dim=_int(hf.get("head_dim"), "head_dim", where,
                                                          default=hidden // heads),
        d_ff=sizes["intermediate_size"], activation=acts[act], tie_embeddings=tie,
        norm_eps=_number(hf.get("rms_norm_eps"), "rms_norm_eps", where, default=1e-6),
        max_seq_len=_int(hf.get("max_position_embeddings"), "max_position_embeddings", where, default=8192))


def _hf_common(cfg: ModelConfig, arch: str, model_type: str, dtype: str) -> dict:
    return {
        "architectures": [arch], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype, "use_cache": True,
    }


# ---------------------------------------------------------------- the families

# The ModelConfig options beyond the Llama shape, and what each family sets them to.
_OPTIONS = ("qkv_bias", "qk_norm", "post_norms", "activation", "embed_scale", "query_pre_attn_scalar",
            "sliding_window", "global_every", "rope_local_theta", "n_experts", "router_norm_topk", "attn_out_bias",
            "attention_sinks", "moe_biases")
_GPT_OSS_ONLY = dict(attn_out_bias=False, attention_sinks=False, moe_biases=False)
_LLAMA_OPTIONS = dict(qkv_bias=False, qk_norm=False, post_norms=False, activation="silu", embed_scale=False,
                      query_pre_attn_scalar=0.0, sliding_window=0, global_every=0, rope_local_theta=0.0,
                      **_GPT_OSS_ONLY)


@dataclasses.dataclass(frozen=True)
class LlamaFamily:
    """Llama-shaped decoders: pre-norm layers, SwiGLU, separate q/k/v/o projections. Subclasses change the
    options (`options`) and add tensors (`extra_layer_maps`)."""
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    options: tuple = tuple(_LLAMA_OPTIONS.items())

    moe: bool = False  # a mixture-of-experts family (jaxmem.io.hf_families_moe)

    def expresses(self, cfg: ModelConfig) -> bool:
        """Whether this family's checkpoints can hold `cfg` (its options are the family's)."""
        return all(getattr(cfg, k) == v for k, v in self.options) and is_moe(cfg) == self.moe

    def param_maps(self, cfg: ModelConfig) -> list[ParamMap]:
        """Every parameter of the Transformer for `cfg`, in HF checkpoint order."""
        layer = _LAYER
        maps = [ParamMap(("embed",), "model.embed_tokens.weight", "same"),
                ParamMap(("layers", "attn_norm"), layer + "input_layernorm.weight", "same")]
        for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v")):
            maps.append(ParamMap(("layers", ours), layer + f"self_attn.{theirs}_proj.weight", "in_heads"))
        if cfg.qkv_bias:
            for ours, theirs in (("bq", "q"), ("bk", "k"), ("bv", "v")):
                maps.append(ParamMap(("layers", ours), layer + f"self_attn.{theirs}_proj.bias", "bias_heads"))
        maps += [ParamMap(("layers", "wo"), layer + "self_attn.o_proj.weight", "out_heads"),
                 *self.extra_layer_maps(cfg),
                 ParamMap(("layers", "mlp_norm"), layer + "post_attention_layernorm.weight", "same"),
                 *self.mlp_maps(cfg),
                 ParamMap(("final_norm",), "model.norm.weight", "same")]
        if not cfg.tie_embeddings:
            maps.append(ParamMap(("lm_head",), "lm_head.weight", "transpose"))
        return maps

    def extra_layer_maps(self, cfg: ModelConfig) -> list[ParamMap]:
        return []

    def mlp_maps(self, cfg: ModelConfig) -> list[ParamMap]:
        return [ParamMap(("layers", "w_gate"), _LAYER + "mlp.gate_proj.weight", "transpose"),
                ParamMap(("layers", "w_up"), _LAYER + "mlp.up_proj.weight", "transpose"),
                ParamMap(("layers", "w_down"), _LAYER + "mlp.down_proj.weight", "transpose")]

    def to_model(self, hf: dict, where: str) -> ModelConfig:
        """config.json -> ModelConfig(preset="custom"); a one-line ConfigError naming the key otherwise."""
        _off(hf, ("attention_bias", "mlp_bias"), where)  # Llama options our layers do not have
        theta, scaling = _rope(hf, where)
        fields = _common(hf, where, act_key="hidden_act", acts={"silu": "silu"}, tie_default=False)
        fields.update(dict(self.options), rope_theta=theta, rope_scaling=scaling)
        return ModelConfig(**self.adjust(hf, fields, where))

    def adjust(self, hf: dict, fields: dict, where: str) -> dict:
        return fields

    def to_hf(self, cfg: ModelConfig, dtype: str) -> dict:
        """The config.json transformers needs to rebuild `cfg` as this architecture."""
        rope = _hf_rope(cfg.rope_theta, cfg.rope_scaling)
        out = _hf_common(cfg, self.architecture, self.model_type, dtype)
        out.update({
            "hidden_act": "silu",
            # rope_parameters for transformers >= 5; rope_theta + rope_scaling for older readers.
            "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None})
        return self.hf_extras(cfg, out)

    def hf_extras(self, cfg: ModelConfig, out: dict) -> dict:
        out.update(attention_bias=False, mlp_bias=False)
        return out


@dataclasses.dataclass(frozen=True)
class MistralFamily(LlamaFamily):
    architecture: str = "MistralForCausalLM"
    model_type: str = "mistral"

    def adjust(self, hf, fields, where):
        return _cap_at_window(hf, fields, where, on=True)

    def hf_extras(self, cfg, out):  # our Llama-shaped layers are full causal: no sliding window
        out.update(sliding_window=None)
        return out


def _cap_at_window(hf: dict, fields: dict, where: str, on: bool) -> dict:
    # Mistral/Qwen2 slide the window on every layer; that equals full causal attention up to the window,
    # so loading caps the sequence length there and keeps the layers full causal (exact).
    if on and hf.get("sliding_window") is not None:
        window = _int(hf["sliding_window"], "sliding_window", where)
        fields["max_seq_len"] = min(fields["max_seq_len"], window)
    return fields


@dataclasses.dataclass(frozen=True)
class Qwen2Family(LlamaFamily):
    architecture: str = "Qwen2ForCausalLM"
    model_type: str = "qwen2"
    options: tuple = tuple(dict(_LLAMA_OPTIONS, qkv_bias=True).items())

    def to_model(self, hf, where):  # Qwen2's attention always has q/k/v biases, whatever attention_bias says
        return super().to_model({k: v for k, v in hf.items() if k != "attention_bias"}, where)

    def adjust(self, hf, fields, where):
        return _cap_at_window(hf, fields, where, on=bool(hf.get("use_sliding_window")))

    def hf_extras(self, cfg, out):
        out.update(sliding_window=None, use_sliding_window=False)
        return out


@dataclasses.dataclass(frozen=True)
class Qwen3Family(LlamaFamily):
    """Qwen3 dense: Llama shape plus an RMSNorm over head_dim on every query and key head, before RoPE."""
    architecture: str = "Qwen3ForCausalLM"
    model_type: str = "qwen3"
    options: tuple = tuple(dict(_LLAMA_OPTIONS, qk_norm=True).items())

    def extra_layer_maps(self, cfg):
        return [ParamMap(("layers", "q_norm"), _LAYER + "self_attn.q_norm.weight", "same"),
                ParamMap(("layers", "k_norm"), _LAYER + "self_attn.k_norm.weight", "same")]

    def adjust(self, hf, fields, where):
        if hf.get("use_sliding_window"):  # Qwen3 windows only the layers past max_window_layers
            raise ConfigError(f"{where}: use_sliding_window=true is not supported for Qwen3; use false")
        return fields

    def hf_extras(self, cfg, out):
        out.update(attention_bias=False, sliding_window=None, use_sliding_window=False)
        return out


_GEMMA3_FIXED = dict(qkv_bias=False, qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=True,
                     **_GPT_OSS_ONLY)


@dataclasses.dataclass(frozen=True)
class Gemma3Family(LlamaFamily):
    """Gemma 3 text (Gemma3ForCausalLM): four (1 + w) RMSNorms per layer, q/k norms, GeGLU, embeddings times
    sqrt(d_model), tied head, local sliding-window layers with global ones every few layers, each kind with
    its own RoPE base (the global one optionally linearly scaled). The (1 + w) weights load as 1 + w
    (layout plus_one), so our norms multiply by the weight as every other family's do."""
    architecture: str = "Gemma3ForCausalLM"
    model_type: str = "gemma3_text"
    options: tuple = tuple(_GEMMA3_FIXED.items())

    def param_maps(self, cfg):
        layer = _LAYER
        maps = [ParamMap(("embed",), "model.embed_tokens.weight", "same"),
                ParamMap(("layers", "attn_norm"), layer + "input_layernorm.weight", "plus_one")]
        for ours, theirs in (("wq", "q"), ("wk", "k"), ("wv", "v")):
            maps.append(ParamMap(("layers", ours), layer + f"self_attn.{theirs}_proj.weight", "in_heads"))
        maps += [ParamMap(("layers", "q_norm"), layer + "self_attn.q_norm.weight", "plus_one"),
                 ParamMap(("layers", "k_norm"), layer + "self_attn.k_norm.weight", "plus_one"),
                 ParamMap(("layers", "wo"), layer + "self_attn.o_proj.weight", "out_heads"),
                 ParamMap(("layers", "attn_post_norm"), layer + "post_attention_layernorm.weight", "plus_one"),
                 ParamMap(("layers", "mlp_norm"), layer + "pre_feedforward_layernorm.weight", "plus_one"),
                 ParamMap(("layers", "w_gate"), layer + "mlp.gate_proj.weight", "transpose"),
                 ParamMap(("layers", "w_up"), layer + "mlp.up_proj.weight", "transpose"),
                 ParamMap(("layers", "w_down"), layer + "mlp.down_proj.weight", "transpose"),
                 ParamMap(("layers", "mlp_post_norm"), layer + "post_feedforward_layernorm.weight", "plus_one"),
                 ParamMap(("final_norm",), "model.norm.weight", "plus_one")]
        if not cfg.tie_embeddings:
            maps.append(ParamMap(("lm_head",), "lm_head.weight", "transpose"))
        return maps

    def to_model(self, hf, where):
        _off(hf, ("attention_bias", "attn_logit_softcapping", "final_logit_softcapping",
                  "use_bidirectional_attention"), where)
        fields = _common(hf, where, act_key="hidden_activation", acts={"gelu_pytorch_tanh": "gelu_tanh"},
                         tie_default=True)
        n_layers = fields["n_layers"]
        rope = hf.get("rope_parameters")
        if isinstance(rope, dict) and "full_attention" in rope:  # transformers >= 5: per layer type
            theta, scaling = _rope({"rope_parameters": rope["full_attention"]}, where)
            local = rope.get("sliding_attention") or {}
            local_theta, local_scaling = _rope({"rope_parameters": local}, where) if local else (10000.0, None)
        else:  # older files: rope_theta / rope_scaling are the global layers', rope_local_base_freq the local's
            theta = _number(hf.get("rope_theta"), "rope_theta", where, default=1_000_000.0)
            scaling = _rope_scaling(hf.get("rope_scaling"), "rope_scaling", where)
            local_theta = _number(hf.get("rope_local_base_freq"), "rope_local_base_freq", where, default=10000.0)
            local_scaling = None
        if local_scaling:
            raise ConfigError(f"{where}: rope_parameters.sliding_attention: only rope_type 'default' is supported "
                              "for the local layers")
        fields.update(_GEMMA3_FIXED, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
                      query_pre_attn_scalar=_number(hf.get("query_pre_attn_scalar"), "query_pre_attn_scalar",
                                                    where, default=256.0),
                      **layer_kinds(hf, n_layers, where, default_window=4096, default_every=6))
        return ModelConfig(**fields)

    def to_hf(self, cfg, dtype):
        out = _hf_common(cfg, self.architecture, self.model_type, dtype)
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        global_rope = _hf_rope(cfg.rope_theta, cfg.rope_scaling)
        out.update({
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
            **hf_layer_kinds(cfg),
            "rope_parameters": {"full_attention": global_rope,
                                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
            "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "use_bidirectional_attention": False})
        return out


def _int_if_whole(x: float):
    return int(x) if float(x).is_integer() else x  # transformers' Gemma3TextConfig types this field int


def layer_kinds(hf: dict, n_layers: int, where: str, *, default_window: int, default_every: int) -> dict:
    """sliding_window and global_every (ModelConfig) from config.json's window and layer pattern; both 0 when
    every layer is global."""
    window = _int(hf.get("sliding_window"), "sliding_window", where, default=default_window)
    every = _global_every(hf, n_layers, where, default_every)
    return {"sliding_window": 0 if every == 1 else window, "global_every": 0 if every == 1 else every}


def hf_layer_kinds(cfg: ModelConfig) -> dict:
    """config.json's sliding_window and layer_types for `cfg`'s local and global layers (layer_kinds' inverse)."""
    full = [not cfg.sliding_window or (cfg.global_every and (i + 1) % cfg.global_every == 0)
            for i in range(cfg.n_layers)]
    return {"sliding_window": cfg.sliding_window or cfg.max_seq_len,
            "layer_types": ["full_attention" if f else "sliding_attention" for f in full]}


def _global_every(hf: dict, n_layers: int, where: str, default_every: int) -> int:
    """The k of 'every k-th layer is global' from layer_types (or the older sliding_window_pattern); 1 when
    every layer is global (no window)."""
    types = hf.get("layer_types")
    if types is None:
        return _int(hf.get("sliding_window_pattern"), "sliding_window_pattern", where, default=default_every)
    if not isinstance(types, list) or len(types) != n_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"{where}: layer_types must list sliding_attention / full_attention once per layer "
                          f"({n_layers})")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[0] + 1 if full else n_layers + 1  # all local: no layer hits the pattern
    if any((t == "full_attention") != ((i + 1) % every == 0) for i, t in enumerate(types)):
        raise ConfigError(f"{where}: layer_types: only a full_attention layer every k-th layer is supported "
                          f"(k = {every} from the first one)")
    return every if full else 0
