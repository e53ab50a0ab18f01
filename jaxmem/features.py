"""The registry: the one module that imports every feature package and hands the features a config turns on
to the core and the planner, which import none of them.

A feature (jaxmem.core.plugins.Feature) brings its rules, its part of the layout, its program hooks, the
checkpoints it reads, and its planner terms. A new lever is a new package and one line in FEATURES. The
entry points that need them all sit here: loading and checking a config, building its program, resolving
its layout, its bill and its plan.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from jaxmem import kernels
from jaxmem.config import validate
from jaxmem.config.schema import Config, apply_overrides, parse_raw, read_yaml
from jaxmem.core import checkpoint, layout as core_layout, program, remat
from jaxmem.core.plugins import Features
from jaxmem.inbackward.feature import UPDATE_IN_BACKWARD
from jaxmem.lora.feature import LORA
from jaxmem.io.model_match import model_from_folder
from jaxmem.model.presets import PRESETS, check_model, resolve_model
from jaxmem.moe.feature import MOE
from jaxmem.offload.feature import HOST_OFFLOAD
from jaxmem.pipeline import runtime
from jaxmem.pipeline.feature import PIPELINE
from jaxmem.preference.feature import PREFERENCE
from jaxmem.rl.feature import RL_FEATURE
from jaxmem.seqpar.feature import SEQUENCE_PARALLEL

FEATURES = (MOE, LORA, HOST_OFFLOAD, UPDATE_IN_BACKWARD, PIPELINE, SEQUENCE_PARALLEL, PREFERENCE, RL_FEATURE)


def for_config(cfg: Config) -> Features:
    """The features `cfg` turns on, in the registry's order."""
    return Features(tuple(f for f in FEATURES if f.applies(cfg)), tuple(f.name for f in FEATURES),
                    tuple(layout for f in FEATURES for layout in f.foreign_layouts))


# ---------------------------------------------------------------- loading and checking


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
    MOE.check(cfg)


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
    "lora": LORA.check,
    "preference": PREFERENCE.check,
    "rl": RL_FEATURE.check,
    "distributed": lambda cfg: validate.check_distributed(cfg.distributed),
    "remat": remat.check,
    "offload": HOST_OFFLOAD.check,
    "kernels": lambda cfg: kernels.check_block_sizes(cfg.kernels),
    "target": validate.check_target,
    "out_dir": lambda cfg: validate.require_out_dir(cfg.out_dir),
}


def _seq_len_fits_model(cfg: Config) -> None:
    validate.seq_len_fits_model(cfg)


def _remat_groups_divide_layers(cfg: Config) -> None:
    remat.group_size(cfg.remat, cfg.model.n_layers)  # "remat.every_k: k does not divide model.n_layers=..."


def _attention_kernel_takes_the_model(cfg: Config) -> None:
    kernels.check_model_kernels(cfg)


def _batch_fits_fixed_mesh(cfg: Config) -> None:
    """With no -1 mesh axis the data ways are known now: the batch rules and the features' rules on the
    micro-batch count run at load."""
    if validate.fixed_mesh_size(cfg.parallel) is not None:
        grad_accum, _ = validate.batch_layout(cfg, cfg.parallel.dp * cfg.parallel.fsdp * cfg.parallel.ep)
        for feature in FEATURES:
            feature.check_micro_batches(cfg, grad_accum)


def _update_in_backward_levers(cfg: Config) -> None:
    UPDATE_IN_BACKWARD.check(cfg)


def _pipeline_levers(cfg: Config) -> None:
    PIPELINE.check(cfg)


CROSS_CHECKS: tuple[Callable[[Config], None], ...] = (
    _seq_len_fits_model,  # train vs model
    _remat_groups_divide_layers,  # remat vs model
    _attention_kernel_takes_the_model,  # kernels vs model
    _batch_fits_fixed_mesh,  # train vs parallel, the features' micro-batch rules vs the derived grad_accum
    _update_in_backward_levers,  # optimizer vs remat, offload, precision
    _pipeline_levers,  # parallel.pp vs model, remat, lora, optimizer, precision, offload
)


# ---------------------------------------------------------------- programs and layouts


def build_program(cfg: Config, mesh=None, devices=None, *, keep: tuple[str, ...] | None = None):
    """jaxmem.core.program.build_program with the features `cfg` turns on."""
    return program.build_program(cfg, mesh, devices, keep=keep, features=for_config(cfg))


def build_run_program(cfg: Config):
    """The program `jaxmem train` runs for `cfg` on all the attached devices: a feature's own (a pipeline's
    stages) or one TrainProgram; both satisfy jaxmem.core.plugins.RunProgram."""
    features = for_config(cfg)
    return features.run_program(cfg) or program.build_program(cfg, features=features)


def build_pipeline(cfg: Config, devices=None, counts=None, *, check: bool = True):
    """jaxmem.pipeline.runtime.build_pipeline with the features `cfg` turns on."""
    return runtime.build_pipeline(cfg, devices, counts, check=check, features=for_config(cfg))


def resolve_layout(cfg: Config, n_devices: int, platform: str, mesh_sizes: dict[str, int] | None = None):
    """jaxmem.core.layout.resolve with the features `cfg` turns on."""
    return core_layout.resolve(cfg, n_devices, platform, mesh_sizes, features=for_config(cfg))


def plugin_for(cfg: Config):
    """The program-level plug-in `cfg`'s features bring (a full fine-tune's hooks where none does)."""
    return for_config(cfg).program_plugin(cfg)


def run_meta(cfg: Config, step: int, data_position: int, batch_rows: int) -> dict:
    """A checkpoint's meta for a step of `cfg` (jaxmem.core.checkpoint.run_meta) with what its program's
    features record (LoRA: the base its adapters belong to)."""
    meta = checkpoint.run_meta(cfg, step, data_position, batch_rows)
    return dict(meta, **plugin_for(cfg).meta(cfg))
