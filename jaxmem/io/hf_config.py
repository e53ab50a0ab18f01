"""Hugging Face config.json <-> jaxmem ModelConfig; each family's translation is its adapter's
(jaxmem.io.hf_families)."""
from __future__ import annotations

import json
from pathlib import Path

from jaxmem.io.hf_registry import FAMILIES, family, family_for_config
from jaxmem.config.schema import ConfigError, ModelConfig

ARCHITECTURES = tuple(FAMILIES)


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
    except RecursionError:  # json's decoder recurses once per level of [ or {
        raise ConfigError(f"{path}: nests its JSON too deeply to read; the file is damaged") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got a {type(value).__name__}")
    return value


def model_config_from_hf(hf: dict, where: str = "config.json") -> ModelConfig:
    """Maps a transformers config.json to ModelConfig(preset="custom"); one-line ConfigError otherwise."""
    if not isinstance(hf, dict):
        raise ConfigError(f"{where}: expected a JSON object, got a {type(hf).__name__}")
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in FAMILIES:
        raise ConfigError(f"{where}: architectures={archs!r} is not supported; use one of {', '.join(FAMILIES)}")
    return FAMILIES[archs[0]].to_model(hf, where)


def default_architecture(cfg: ModelConfig) -> str:
    return family_for_config(cfg).architecture


def hf_config_from_model(cfg: ModelConfig, dtype: str, architecture: str | None = None) -> dict:
    """The config.json transformers needs to rebuild `cfg` as `architecture` (default: the family that
    holds `cfg`'s options)."""
    fam = family(architecture) if architecture else family_for_config(cfg)
    if not fam.expresses(cfg):
        wanted = ", ".join(f"model.{k}={v!r}" for k, v in fam.options if getattr(cfg, k) != v)
        raise ConfigError(f"architecture: {fam.architecture} needs {wanted}")
    return fam.to_hf(cfg, dtype)
