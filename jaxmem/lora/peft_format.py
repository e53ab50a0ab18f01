"""LoRA adapters in Hugging Face PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT stores, per layer and target, lora_A [r, in_features] and lora_B [out_features, r] such that the
HF weight [out, in] becomes W + scale * lora_B @ lora_A. Ours are A [*in_shape, r] and B [r, *out_shape]
per layer; flattening the head dims row-major is the same order jaxmem.io.hf_layout uses for the base weights.
A mixture of experts' adapters are one pair per layer and expert, under the family's expert module names
(base_model.model.model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight; Mixtral: block_sparse_moe.experts.
{e}.w1), and target_modules names them as the family does (gate_proj, up_proj, down_proj; Mixtral w1, w3, w2).
"""
from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.flax import save_file

from jaxmem.io.hf_config import read_json_object
from jaxmem.lora.adapters import (ALL_LINEAR, PARAM_ORDER, hf_target_names, model_targets, resolve_targets, scale,
                                  target_weights)
from jaxmem.config.schema import ConfigError, ModelConfig, NotYetSupported

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model.model.layers.{layer}."
# PEFT config keys whose non-default values this format does not carry; WRITTEN ones go into every
# adapter_config.json, the others (newer PEFT keys) are only checked when present.
WRITTEN_DEFAULTS = {"layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                    "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False, "bias": "none"}
UNSUPPORTED = {**WRITTEN_DEFAULTS, "lora_bias": False, "layer_replication": None, "target_parameters": None,
               "exclude_modules": None, "trainable_token_indices": None, "use_qalora": False}


def tensor_names(layer: int, hf_module: str, expert: int | None = None) -> tuple[str, str]:
    """PEFT's (lora_A, lora_B) tensor names for one layer's module, e.g. hf_module "self_attn.q_proj" (an
    expert's, "mlp.experts.{expert}.gate_proj", with its expert index)."""
    base = KEY_PREFIX.format(layer=layer) + hf_module.format(expert=expert)
    return base + ".lora_A.weight", base + ".lora_B.weight"


def _slots(w, n_layers: int):
    """(index into our [L, *lead] stacks, layer, expert or None) for every PEFT pair of weight `w`."""
    if not w.lead_shape:
        return [((layer,), layer, None) for layer in range(n_layers)]
    return [((layer, e), layer, e) for layer in range(n_layers) for e in range(w.lead_shape[0])]


def _check_per_expert_modules(w) -> None:
    """PEFT names an expert adapter per expert module; gpt-oss keeps its experts in stacked tensors, which PEFT
    adapts through target_parameters instead, a layout not written or read here."""
    if w.lead_shape and "{expert}" not in w.hf_module:
        raise NotYetSupported(f"adapters.layers.{w.param}: PEFT files for adapters on experts stored as one "
                                  f"stacked tensor ({w.hf_module}, gpt-oss) are not supported yet; merge them "
                                  "(jaxmem merge-lora) or leave the experts out of lora.targets")


def save_peft(adapters: dict, model_cfg: ModelConfig, path, *, rank: int, alpha: float, rslora: bool = False,
              dropout: float = 0.0, targets: tuple[str, ...] | None = None, base_model: str = "") -> Path:
    """Writes `adapters` (our tree, stacked on L) as a PEFT LoRA adapter directory; returns `path`.

    `targets` are our param names or HF module names (default: every adapter in `adapters`); tensors keep
    the adapters' dtype.
    """
    path = Path(path)
    layers = adapters["layers"]
    by_hf = model_targets(model_cfg)
    wanted = [by_hf.get(t, t) for t in (targets or layers)]  # HF module names or ours
    for name in wanted:
        if name not in layers:
            raise ConfigError(f"save_peft targets: {name!r} has no adapter; the adapters hold {', '.join(layers)}")
    targets = tuple(p for p in PARAM_ORDER if p in wanted)
    weights = target_weights(model_cfg)
    tensors = {}
    for param in targets:
        w = weights.get(param)
        if w is None:
            raise ConfigError(f"adapters.layers.{param}: the model has no such weight; it has {', '.join(weights)}")
        _check_per_expert_modules(w)
        a, b = np.asarray(layers[param]["a"]), np.asarray(layers[param]["b"])
        expected_a = (model_cfg.n_layers, *w.lead_shape, *w.in_shape, rank)
        expected_b = (model_cfg.n_layers, *w.lead_shape, rank, *w.out_shape)
        if a.shape != expected_a or b.shape != expected_b:
            raise ConfigError(f"adapters.layers.{param}: A {list(a.shape)} and B {list(b.shape)} do not fit the "
                              f"model; expected A {list(expected_a)}, B {list(expected_b)}")
        for index, layer, expert in _slots(w, model_cfg.n_layers):
            name_a, name_b = tensor_names(layer, w.hf_module, expert)
            tensors[name_a] = jnp.asarray(np.ascontiguousarray(a[index].reshape(w.in_features, rank).T))
            tensors[name_b] = jnp.asarray(np.ascontiguousarray(b[index].reshape(rank, w.out_features).T))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
        "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": rslora,
        "target_modules": hf_target_names(targets, model_cfg), "inference_mode": True, "init_lora_weights": True,
        **WRITTEN_DEFAULTS,
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path


def _settings(config: dict, where: Path, model_cfg: ModelConfig | None = None) -> dict:
    """The LoRA settings of a PEFT adapter_config.json; ConfigError for what this format cannot carry."""
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type is {config.get('peft_type')!r}; only LORA adapters are supported")
    for key, default in UNSUPPORTED.items():
        if config.get(key) is not None and config[key] != default:
            raise ConfigError(f"{where}: {key} is {config[key]!r}; only {default!r} is supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise ConfigError(f"{where}: {key} is {config.get(key)!r}; expected a positive number")
    if not isinstance(config["r"], int):
        raise ConfigError(f"{where}: r is {config['r']!r}; expected a positive integer")
    modules = config.get("target_modules")
    allowed = model_targets(model_cfg)
    if not isinstance(modules, (list, str)) or (isinstance(modules, str) and modules != ALL_LINEAR
                                                and modules not in allowed):
        raise ConfigError(f"{where}: target_modules is {modules!r}; expected a list of "
                          f"{', '.join(allowed)} or {ALL_LINEAR!r}")
    targets = resolve_targets(modules, key=f"{where}: target_modules", model=model_cfg)
    rslora = bool(config.get("use_rslora", False))
    return {"rank": config["r"], "alpha": config["lora_alpha"], "rslora": rslora,
            "dropout": float(config.get("lora_dropout", 0.0)), "targets": targets,
            "base_model": config.get("base_model_name_or_path") or "",
            "scale": scale(config["lora_alpha"], config["r"], rslora)}


def load_peft(path, model_cfg: ModelConfig) -> tuple[dict, dict]:
    """Reads a PEFT LoRA adapter directory for a model of `model_cfg`.

    Returns (adapters, settings): our adapter tree (stacked on L, in the file's dtype) and
    {"rank", "alpha", "rslora", "dropout", "targets" (our param names), "base_model", "scale"}.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise ConfigError(f"{f}: not found; expected a PEFT adapter directory ({CONFIG_FILE}, {WEIGHTS_FILE})")
    settings = _settings(read_json_object(config_file), config_file, model_cfg)
    rank = settings["rank"]
    weights = target_weights(model_cfg)
    try:
        handle = safe_open(str(weights_file), framework="flax")
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{weights_file}: not a readable safetensors file ({e})") from None
    with handle:
        present = set(handle.keys())
        layers = {}
        for param in settings["targets"]:
            w = weights[param]
            _check_per_expert_modules(w)
            stacks = {"a": [], "b": []}
            for _, layer, expert in _slots(w, model_cfg.n_layers):
                for part, name, expected in zip(("a", "b"), tensor_names(layer, w.hf_module, expert),
                                                ((rank, w.in_features), (w.out_features, rank))):
                    if name not in present:
                        raise ConfigError(f"{weights_file}: tensor {name} is missing")
                    shape = tuple(handle.get_slice(name).get_shape())
                    if shape != expected:
                        raise ConfigError(f"{weights_file}: tensor {name} has shape {list(shape)}, the model and "
                                          f"r={rank} imply {list(expected)}; the adapter is for another model")
                    stacks[part].append(handle.get_tensor(name))
            lead = (model_cfg.n_layers, *w.lead_shape)
            a = jnp.stack([t.T.reshape(*w.in_shape, rank) for t in stacks["a"]])
            b = jnp.stack([t.T.reshape(rank, *w.out_shape) for t in stacks["b"]])
            layers[param] = {"a": a.reshape(*lead, *a.shape[1:]), "b": b.reshape(*lead, *b.shape[1:])}
        expected_names = {n for p in settings["targets"] for _, i, e in _slots(weights[p], model_cfg.n_layers)
                          for n in tensor_names(i, weights[p].hf_module, e)}
        extra = sorted(present - expected_names)
        if extra:
            raise ConfigError(f"{weights_file}: tensor {extra[0]} does not belong to the model's "
                              f"{model_cfg.n_layers} layers and targets ({len(extra)} such tensors)")
    return {"layers": layers}, settings
