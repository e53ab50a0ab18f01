"""Loading and checking a config: YAML and dotted overrides to a validated Config, with every rule that needs
only the config, each section's, then those across sections, the registry's features' among them
(jaxmem.registry.FEATURES, looped over: this module names no feature).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from jaxmem import kernels, registry
from jaxmem.config import validate
from jaxmem.config.schema import Config, apply_overrides, parse_raw, read_yaml
from jaxmem.core import offload_rules, remat
from jaxmem.io.model_match import model_from_folder
from jaxmem.model.presets import PRESETS, check_model, resolve_model


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML config (or the defaults), applies dotted overrides, resolves presets and validates."""
    raw = read_yaml(path) if path else {}
    return from_dict(apply_overrides(raw, overrides or []))


def from_dict(raw: dict) -> Config:
    """The validated Config of a raw mapping (as read from YAML, or `jaxmem.config.to_dict`'s output)."""
    cfg = parse_raw(raw)
    cfg = dataclasses.replace(cfg, model=_model_of(cfg, raw.get("model") or {}))
    check(cfg)
    return cfg


def _model_of(cfg: Config, raw_model: dict):
    """The run's model: the folder's architecture where checkpoint.init_from names a Hugging Face directory or
    an import-hf output (model.* keys the config sets must agree with it), else the preset's with the keys
    the config sets."""
    resolved = resolve_model(cfg.model, raw_model)  # refuses an unknown preset first
    preset = raw_model.get("preset")
    preset_values = PRESETS[preset] if preset and preset != "custom" else {}
    return model_from_folder(cfg.checkpoint.init_from, cfg.model, raw_model, preset_values) or resolved


def check(cfg: Config) -> None:
    """Every rule that needs only the config, each section's then those across sections; for a Config built
    or changed in code too."""
    for section_rules in SECTION_VALIDATORS.values():
        section_rules(cfg)
    for rule in CROSS_CHECKS:
        rule(cfg)


def _model(cfg: Config) -> None:
    validate.check_model(cfg)
    check_model(cfg.model)


# Each takes the whole Config (a section's rules may read the sections it depends on) and raises a one-line
# ConfigError naming the key. Run in this order (remat before offload: offload reads the remat preset).
SECTION_VALIDATORS: dict[str, Callable[[Config], None]] = {
    "model": _model,
    "train": validate.check_train,
    "optimizer": validate.check_optimizer,
    "parallel": validate.check_parallel,
    "precision": validate.check_precision,
    "data": validate.check_data,
    "checkpoint": validate.check_checkpoint,
    "distributed": lambda cfg: validate.check_distributed(cfg.distributed),
    "remat": remat.check,
    "offload": offload_rules.check,
    "kernels": lambda cfg: kernels.check_block_sizes(cfg.kernels),
    "target": validate.check_target,
    "out_dir": lambda cfg: validate.require_out_dir(cfg.out_dir),
}


def _features_rules(cfg: Config) -> None:
    """Each feature's rules at load, refused combinations included (jaxmem.core.plugins.Feature.check), in the
    registry's order: a mixture of experts' sizes, LoRA's, update in backward's and the pipeline's levers."""
    for feature in registry.FEATURES:
        feature.check(cfg)


def _seq_len_fits_model(cfg: Config) -> None:
    validate.seq_len_fits_model(cfg)


def _remat_groups_divide_layers(cfg: Config) -> None:
    remat.group_size(cfg.remat, cfg.model.n_layers)  # "remat.every_k: k does not divide model.n_layers=..."


def _attention_kernel_takes_the_model(cfg: Config) -> None:
    kernels.check_model_kernels(cfg)


def _batch_fits_fixed_mesh(cfg: Config) -> None:
    """With no -1 mesh axis the data ways are known now: the batch rules and the micro-batch count rules (host
    offload's, the features') run at load."""
    if validate.fixed_mesh_size(cfg.parallel) is not None:
        grad_accum, _ = validate.batch_layout(cfg, cfg.parallel.dp * cfg.parallel.fsdp * cfg.parallel.ep)
        offload_rules.check_micro_batches(cfg, grad_accum)
        for feature in registry.FEATURES:
            feature.check_micro_batches(cfg, grad_accum)


CROSS_CHECKS: tuple[Callable[[Config], None], ...] = (
    _features_rules,  # the features' levers vs model, parallel, remat, offload, precision, optimizer
    _seq_len_fits_model,  # train vs model
    _remat_groups_divide_layers,  # remat vs model
    _attention_kernel_takes_the_model,  # kernels vs model
    _batch_fits_fixed_mesh,  # train vs parallel, the micro-batch rules vs the derived grad_accum
)
