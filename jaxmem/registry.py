"""The registry: the one module that imports every feature package, and hands the features a config turns on
to the core and the planner, which import none of them.

A feature (jaxmem.core.plugins.Feature) brings its rules, its part of the layout, its program hooks, the
checkpoints it reads, and its planner terms. A new lever is a new package and one line in FEATURES. The
functions below are the core's entry points with the features `cfg` turns on: building its program,
resolving its layout, the plug-in and the checkpoint meta of its run. Loading and checking a config is
jaxmem.loader's; the library surface for scripts is jaxmem.api.
"""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.core import checkpoint, layout, program
from jaxmem.core.plugins import Features
from jaxmem.inbackward.feature import UPDATE_IN_BACKWARD
from jaxmem.lora.feature import LORA
from jaxmem.moe.feature import MOE
from jaxmem.pipeline import runtime
from jaxmem.pipeline.feature import PIPELINE
from jaxmem.preference.feature import PREFERENCE
from jaxmem.rl.feature import RL_FEATURE

FEATURES = (MOE, LORA, UPDATE_IN_BACKWARD, PIPELINE, PREFERENCE, RL_FEATURE)


def for_config(cfg: Config) -> Features:
    """The features `cfg` turns on, in the registry's order."""
    return Features(tuple(f for f in FEATURES if f.applies(cfg)), tuple(f.name for f in FEATURES),
                    tuple(saved for f in FEATURES for saved in f.foreign_layouts))


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
    return layout.resolve(cfg, n_devices, platform, mesh_sizes, features=for_config(cfg))


def plugin_for(cfg: Config):
    """The program-level plug-in `cfg`'s features bring (a full fine-tune's hooks where none does)."""
    return for_config(cfg).program_plugin(cfg)


def run_meta(cfg: Config, step: int, data_position: int, batch_rows: int) -> dict:
    """A checkpoint's meta for a step of `cfg` (jaxmem.core.checkpoint.run_meta) with what its program's
    features record (LoRA: the base its adapters belong to)."""
    meta = checkpoint.run_meta(cfg, step, data_position, batch_rows)
    return dict(meta, **plugin_for(cfg).meta(cfg))
