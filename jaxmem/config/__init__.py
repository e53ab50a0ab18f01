"""The run configuration's schema (jaxmem.config.schema), its config-only rules (jaxmem.config.validate), the
checkpoint names (jaxmem.config.names) and the GPU targets (jaxmem.config.targets): the floor every other
package stands on. Loading a config with every rule, the features' included, is the registry's:
`jaxmem.load_config` (jaxmem.loader.load_config).

The schema's names (Config, ConfigError, the section dataclasses, to_dict, ...) are re-exported here.
"""
from __future__ import annotations

import importlib

# name -> the module that defines it, imported on first use: this __init__ runs on every import of a
# module of the package, and jaxmem.config.schema must stay a leaf.
_ORIGIN = {
    "ConfigError": "jaxmem.config.schema",
    "Dtype": "jaxmem.config.schema",
    "ModelConfig": "jaxmem.config.schema",
    "ParallelConfig": "jaxmem.config.schema",
    "LossScaleConfig": "jaxmem.config.schema",
    "PrecisionConfig": "jaxmem.config.schema",
    "OptimizerConfig": "jaxmem.config.schema",
    "TrainConfig": "jaxmem.config.schema",
    "DataConfig": "jaxmem.config.schema",
    "CheckpointConfig": "jaxmem.config.schema",
    "DistributedConfig": "jaxmem.config.schema",
    "RematConfig": "jaxmem.config.schema",
    "OffloadConfig": "jaxmem.config.schema",
    "KernelConfig": "jaxmem.config.schema",
    "TargetConfig": "jaxmem.config.schema",
    "Config": "jaxmem.config.schema",
    "to_dict": "jaxmem.config.schema",
    "apply_overrides": "jaxmem.config.schema",
    "parse_yaml_file": "jaxmem.config.schema",
    "read_yaml": "jaxmem.config.schema",
    "parse_raw": "jaxmem.config.schema",
    "config_hash": "jaxmem.config.schema",
    "dump_yaml": "jaxmem.config.schema",
}

__all__ = [
    "ConfigError", "Dtype", "ModelConfig", "ParallelConfig", "LossScaleConfig", "PrecisionConfig",
    "OptimizerConfig", "TrainConfig", "DataConfig", "CheckpointConfig", "DistributedConfig", "RematConfig",
    "OffloadConfig", "KernelConfig", "TargetConfig", "Config", "to_dict", "apply_overrides",
    "parse_yaml_file", "read_yaml", "parse_raw", "config_hash", "dump_yaml",
]


def __getattr__(name):
    if name in _ORIGIN:
        value = getattr(importlib.import_module(_ORIGIN[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxmem.config' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_ORIGIN))
