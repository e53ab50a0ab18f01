"""Whether a params checkpoint holds the run's model, and the model a checkpoint folder describes: the ModelConfig
fields that must agree between an `init_from` checkpoint (a `jaxmem import-hf` output's model.json, a Hugging
Face config.json) and the run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxmem.io.hf_config import model_config_from_hf, read_json_object
from jaxmem.config.schema import Config, ConfigError, ModelConfig

KEY = "checkpoint.init_from"
MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "qkv_bias", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps",
              # Qwen3 / Gemma 3: same shapes, another function (docs/models.md)
              "qk_norm", "post_norms", "activation", "embed_scale", "query_pre_attn_scalar", "sliding_window",
              "global_every", "rope_local_theta")
# The model.* keys a run chooses whatever checkpoint it starts from; every other key is the architecture's.
RUN_CHOICES = ("preset", "max_seq_len", "router_aux_loss_coef", "router_z_loss_coef", "moe_capacity_factor")
ARCHITECTURE_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUN_CHOICES)


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face checkpoint directory (config.json and safetensors), not a `jaxmem import-hf` output."""
    path = Path(path)
    return (path / "config.json").is_file() and not (path / "model.json").is_file()


def is_imported_dir(path: str | Path) -> bool:
    """A `jaxmem import-hf` output (model.json + params/)."""
    path = Path(path)
    return (path / "model.json").is_file() and (path / "params").is_dir()


EXPECTED = ("expected a Hugging Face folder (config.json + *.safetensors) or a `jaxmem import-hf` output "
            "(model.json + params/)")


def check_is_model(path: str | Path) -> None:
    """A one-line ConfigError naming `path` unless it is a model: a Hugging Face folder (config.json and its
    safetensors) or a `jaxmem import-hf` output (model.json + params/). Every command resolves init_from
    through here at load (jaxmem.loader), so none plans, tunes or trains another model than the one named."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{KEY}: {path} does not exist ({EXPECTED})")
    if not path.is_dir():
        raise ConfigError(f"{KEY}: {path} is not a folder ({EXPECTED})")
    if is_hf_dir(path):
        if not any(path.glob("*.safetensors")) and not (path / "model.safetensors.index.json").is_file():
            raise ConfigError(f"{KEY}: {path} has a config.json but no *.safetensors weights ({EXPECTED})")
    elif (path / "model.json").is_file():
        if not (path / "params").is_dir():
            raise ConfigError(f"{KEY}: {path / 'params'} not found ({EXPECTED})")
    else:
        raise ConfigError(f"{KEY}: {path} holds neither config.json nor model.json ({EXPECTED})")


def folder_model(path: str | Path) -> tuple[ModelConfig, Path] | None:
    """(the model, the file that describes it) of the checkpoint folder `path` names: a Hugging Face directory's
    config.json or an import-hf output's model.json; None where no path is named. A named path that is no
    model is a one-line ConfigError (check_is_model): a named model is never replaced by a preset."""
    if not path:
        return None
    check_is_model(path)
    if is_hf_dir(path):
        config_file = Path(path) / "config.json"
        return model_config_from_hf(read_json_object(config_file), where=str(config_file)), config_file
    model_json = Path(path) / "model.json"  # an import-hf output: check_is_model allows no third kind
    saved = read_json_object(model_json)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in saved.items() if k in known}), model_json


def _differences(theirs: ModelConfig, mine: dict, keys) -> list[str]:
    return [f"{k}={mine[k]!r} (the folder: {getattr(theirs, k)!r})" for k in keys if getattr(theirs, k) != mine[k]]


def model_from_folder(path: str | Path, given: ModelConfig, raw_model: dict, preset_values: dict) -> ModelConfig | None:
    """The run's model where `checkpoint.init_from` names a checkpoint folder: the folder's architecture, with the
    run choices (RUN_CHOICES) the config sets; None where no path is named (a path that is no model is a
    one-line ConfigError).

    Args:
      given: the config's model section as parsed (explicit keys set, the rest defaults).
      raw_model: the keys the config sets explicitly under `model:`.
      preset_values: the values of the preset the config names explicitly ({} where it names none or custom).
    Every architecture key the config sets, itself or through its preset, that disagrees with the folder is
    listed in one ConfigError line.
    """
    found = folder_model(path)
    if found is None:  # no path named
        return None
    theirs, where = found
    explicit = {k: getattr(given, k) for k in ARCHITECTURE_KEYS if k in raw_model}
    wrong = [f"model.{d}" for d in _differences(theirs, explicit, explicit)]
    from_preset = {k: v for k, v in preset_values.items() if k in ARCHITECTURE_KEYS and k not in raw_model}
    preset_wrong = _differences(theirs, from_preset, from_preset)
    if preset_wrong:
        wrong.append(f"model.preset={given.preset} sets {', '.join(preset_wrong)}")
    if wrong:
        raise ConfigError(f"{KEY}: {where} describes another model than the config's: {'; '.join(wrong)}; leave "
                          "these keys out of the model section (the folder gives the architecture) or name the "
                          "matching folder")
    choices = {k: getattr(given, k) for k in RUN_CHOICES if k in raw_model and k != "preset"}
    return dataclasses.replace(theirs, preset="custom", **choices)


def check_hf_config(path: str | Path, cfg: Config) -> None:
    """A one-line ConfigError naming config.json if it describes another model than the run's (every
    architecture key that differs)."""
    config_file = Path(path) / "config.json"
    theirs = model_config_from_hf(read_json_object(config_file), where=str(config_file))
    wrong = [f"{k}={getattr(theirs, k)!r} (the run: model.{k}={getattr(cfg.model, k)!r})"
             for k in ARCHITECTURE_KEYS if getattr(theirs, k) != getattr(cfg.model, k)]
    if wrong:
        raise ConfigError(f"{KEY}: {config_file} describes a model with {', '.join(wrong)}; make the model config "
                          "match, or leave the model section out (the folder then gives it)")


def check_model_json(path: str | Path, cfg: Config) -> None:
    """Raises a one-line ConfigError if `<path>/model.json` describes another model."""
    model_json = Path(path) / "model.json"
    if not model_json.is_file():
        raise ConfigError(f"{KEY}: {model_json} not found ({EXPECTED})")
    saved = read_json_object(model_json)
    mine = dataclasses.asdict(cfg.model)
    for key in MODEL_KEYS:
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(f"{KEY}: {path} holds a model with {key}={saved[key]!r} but the run "
                              f"has model.{key}={mine[key]!r}; make the model config match")
