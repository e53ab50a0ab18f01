"""The run configuration's schema: typed, frozen dataclasses, ConfigError, YAML reading and dotted
`key=value` overrides.

It imports no other jaxmem module, so every module that owns a vocabulary (model presets, remat, kernels,
targets, offload) imports its types from here, and `jaxmem.validate` and `jaxmem.config` (the loader users
call) sit above them: imports go one way.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad config value; the message is one line and names the key."""


Dtype = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str = "tiny"
    vocab_size: int = 0
    d_model: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0
    head_dim: int = 0
    d_ff: int = 0
    rope_theta: float = 10000.0
    # Llama-3 style frequency scaling: {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}; None means plain theta.
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 8192


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    dp: int = 1
    fsdp: int = -1
    tp: int = 1
    rules: Literal["fsdp", "fsdp_tp", "dp"] = "fsdp"
    zero_stage: Literal[1, 2, 3] = 3


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    enabled: bool = False
    init_scale: float = 2.0**15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    master_weights: bool = False  # fp32 master copy held by the optimizer
    grad_reduce_dtype: Dtype = "float32"
    moment_dtype: Literal["float32", "bfloat16"] = "float32"
    loss_scale: LossScaleConfig = LossScaleConfig()


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: train.steps
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    micro_batch: int = 1  # per data-parallel way
    seq_len: int = 128
    global_batch: int = 0  # 0: micro_batch x data ways x grad_accum
    grad_accum: int = 0  # 0: derived from global_batch, or 1
    log_every: int = 10
    seed: int = 0
    progress: bool = True
    tensorboard: bool = False


@dataclasses.dataclass(frozen=True)
class DataConfig:
    kind: Literal["synthetic", "text", "bin"] = "synthetic"
    path: str = ""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    tokenizer: str = ""  # optional tokenizer.json for kind=text; default: bytes


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # 0: only at the end
    keep: int = 3
    async_save: bool = True
    enabled: bool = True
    init_from: str = ""  # params-only orbax checkpoint (e.g. from `jaxmem import-hf`) to start from


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    auto: bool = True  # SLURM/cluster auto-detection when no coordinator is given


@dataclasses.dataclass(frozen=True)
class RematConfig:
    preset: str = "none"
    granularity: Literal["layer", "segments", "every_k", "nested"] = "layer"
    every_k: int = 1
    # per checkpoint name: remat | device | offload; overrides the preset
    names: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    optimizer: Literal["device", "host"] = "device"
    optimizer_update: Literal["host", "device"] = "host"
    params: Literal["device", "host"] = "device"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    loss: Literal["auto", "naive", "chunked", "pallas", "triton"] = "auto"
    attention: Literal["auto", "xla", "pallas", "cudnn"] = "auto"
    norm: Literal["auto", "xla", "pallas"] = "auto"
    loss_block_t: int = 1024  # chunked loss: tokens per tile
    loss_block_v: int = 4096  # chunked loss: vocab columns per tile
    fused_loss_block_t: int = 128  # pallas / triton loss tiles (powers of two)
    fused_loss_block_v: int = 128
    fused_loss_block_d: int = 64
    fused_loss_slab_v: int = 16384  # vocab columns per backward pass: bounds the fp32 dW scratch
    attn_block_q: int = 64
    attn_block_k: int = 64
    z_loss: float = 0.0


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    name: str = ""  # empty: the attached devices
    gpus_per_host: int = 0  # 0: from the mesh size
    hosts: int = 1
    headroom: float = 0.10
    host_ram_gb: float = 0.0  # 0: the target's default


@dataclasses.dataclass(frozen=True)
class Config:
    out_dir: str = "runs/default"
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    precision: PrecisionConfig = PrecisionConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()
    remat: RematConfig = RematConfig()
    offload: OffloadConfig = OffloadConfig()
    kernels: KernelConfig = KernelConfig()
    target: TargetConfig = TargetConfig()


# ---------------------------------------------------------------- building


def _allowed(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if value == c and type(value) is type(c):
                return c
            if isinstance(c, int) and isinstance(value, str) and value.lstrip("-").isdigit() and int(value) == c:
                return c
        raise ConfigError(f"{key}: {value!r} is not allowed; use {_allowed(tp)}")
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or value == "null":
            return None
        return _coerce(value, args[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: {value!r} is not a bool; use true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: {value!r} is not an int")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: {value!r} is not an int")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: {value!r} is not a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: {value!r} is not a string")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: {value!r} is not a mapping")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
        return _build(tp, value, key + ".")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls, raw: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed keys are {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in raw.items()}
    return cls(**kwargs)


def _to_raw(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_raw(v) for k, v in obj.items()}
    return obj


def to_dict(cfg: Config) -> dict:
    return _to_raw(cfg)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = json.loads(json.dumps(raw))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=10")
        key, text = item.split("=", 1)
        _set_dotted(raw, key.strip(), _parse_scalar(text))
    return raw


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a repeated key: YAML keeps the last one, silently dropping a whole section."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key_node.value!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def parse_yaml_file(path: Path) -> Any:
    """A YAML file's content; bad bytes or syntax are a one-line ConfigError naming the file."""
    try:
        return yaml.load(path.read_bytes(), Loader=_ConfigLoader)  # bytes: YAML detects UTF-8/UTF-16 itself
    except yaml.reader.ReaderError as e:
        raise ConfigError(f"{path}: binary content ({e.reason} at byte {e.position}); "
                          "a config is a UTF-8 YAML file") from None
    except yaml.MarkedYAMLError as e:
        where = f"line {e.problem_mark.line + 1}: " if e.problem_mark else ""
        raise ConfigError(f"{path}: not valid YAML ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    raw = parse_yaml_file(path)
    if raw is None:  # an empty file (or only comments) is more likely a mistake than a wish for the defaults
        raise ConfigError(f"{path}: empty config; expected a mapping of sections such as model: and train:")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is not None:  # a config may extend another one, relative to itself
        raw = _merge(_read_base(path, base, _chain), raw)
    return raw


def _read_base(path: Path, base: Any, chain: tuple[Path, ...]) -> dict:
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    parent = path.parent / base
    if not parent.is_file():
        raise ConfigError(f"{path}: base {base} not found (looked for {parent})")
    chain = (*chain, path.resolve())
    if parent.resolve() in chain:
        raise ConfigError(f"{path}: base {base} leads back to {parent} (a cycle of base: files)")
    return read_yaml(parent, chain)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_raw(raw: dict) -> Config:
    """The typed Config of a raw mapping: unknown keys and wrong types are refused here; `model.*` is not yet
    filled from its preset and no cross-key rule has run (jaxmem.validate.from_dict does both)."""
    return _build(Config, raw)


def config_hash(cfg: Config, extra: str = "") -> str:
    text = json.dumps(to_dict(cfg), sort_keys=True) + extra
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dump_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
