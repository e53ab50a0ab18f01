"""Whether a params checkpoint holds the run's model: the ModelConfig fields that must agree between an
`init_from` checkpoint (a `jaxmem import-hf` output's model.json, a Hugging Face config.json) and the run."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxmem.io.hf_config import read_json_object
from jaxmem.config.schema import Config, ConfigError

MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
              "qkv_bias", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps",
              # Qwen3 / Gemma 3: same shapes, another function (docs/models.md)
              "qk_norm", "post_norms", "activation", "embed_scale", "query_pre_attn_scalar", "sliding_window",
              "global_every", "rope_local_theta")


def check_model_json(path: str | Path, cfg: Config) -> None:
    """Raises a one-line ConfigError if `<path>/model.json` describes another model."""
    model_json = Path(path) / "model.json"
    if not model_json.is_file():
        hf = ("; a Hugging Face directory is read directly by LoRA runs only: run `jaxmem import-hf` on it"
              if (Path(path) / "config.json").is_file() else "")
        raise ConfigError(f"checkpoint.init_from: {model_json} not found (expected a `jaxmem import-hf` output "
                          f"dir{hf})")
    saved = read_json_object(model_json)
    mine = dataclasses.asdict(cfg.model)
    for key in MODEL_KEYS:
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(f"checkpoint.init_from: {path} holds a model with {key}={saved[key]!r} but the run "
                              f"has model.{key}={mine[key]!r}; make the model config match")
