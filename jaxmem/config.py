"""The run configuration as users load it: `load_config(path, overrides)` reads YAML and dotted overrides
into the typed schema (jaxmem.schema), fills `model.*` from its preset, and runs every check
(jaxmem.validate) in one pass, so a bad config is a one-line ConfigError before anything is built.

The schema's names (Config, ConfigError, the section dataclasses, to_dict, ...) are re-exported here.
"""
from __future__ import annotations

from jaxmem.schema import (
    ConfigError, Dtype, ModelConfig, ParallelConfig, LossScaleConfig, PrecisionConfig, OptimizerConfig,
    TrainConfig, DataConfig, CheckpointConfig, DistributedConfig, RematConfig, OffloadConfig,
    KernelConfig, TargetConfig, Config, to_dict, apply_overrides, parse_yaml_file, read_yaml, parse_raw,
    config_hash, dump_yaml,
)
from jaxmem.validate import check, from_dict, load_config

__all__ = [
    "ConfigError", "Dtype", "ModelConfig", "ParallelConfig", "LossScaleConfig", "PrecisionConfig",
    "OptimizerConfig", "TrainConfig", "DataConfig", "CheckpointConfig", "DistributedConfig", "RematConfig",
    "OffloadConfig", "KernelConfig", "TargetConfig", "Config", "to_dict", "apply_overrides",
    "parse_yaml_file", "read_yaml", "parse_raw", "config_hash", "dump_yaml", "check", "from_dict",
    "load_config",
]
