"""The rules a run config must satisfy that need the config alone: each section's ranges and the cross-key
rules between sections, each a one-line ConfigError naming the key. The rules that need a vocabulary (model
presets, remat policies, kernels) live beside it, and each feature brings its own (jaxmem.core.plugins.Feature);
the loader (jaxmem.loader) runs them all at load.

The rules that need the device count live here too, as functions called once it is known: `batch_layout`
(jaxmem.core.layout, which program and the bill share), `per_host_from_mesh` and `check_topology`
(jaxmem.runtime.aot.resolve_topology). (Filling a -1 mesh axis is jaxmem.mesh.sharding.mesh_shape's.)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

from jaxmem.config.schema import (CHAT_ROLES, RECORD_KINDS, Config, ConfigError, DistributedConfig, ParallelConfig,
                                  check_choice)
from jaxmem.config.targets import get_target


def positive(key: str, v) -> None:
    if v <= 0:
        raise ConfigError(f"{key}: must be > 0, got {v}")


def check_model(cfg: Config) -> None:
    m = cfg.model
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
        positive(f"model.{k}", getattr(m, k))
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    check_model_numbers(cfg)


def check_model_numbers(cfg: Config) -> None:
    """The model's real-valued keys are finite (a NaN or an infinity trains to a NaN loss at the first step),
    the norm's epsilon and RoPE's base positive (0 divides by zero, a negative base has no real frequencies)."""
    m = cfg.model
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"model.{f.name}: must be a finite number, got {value}")
    for key in ("norm_eps", "rope_theta"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key}: must be > 0, got {getattr(m, key)}")


def check_train(cfg: Config) -> None:
    for k in ("steps", "micro_batch", "seq_len", "log_every"):
        positive(f"train.{k}", getattr(cfg.train, k))
    if cfg.train.global_batch < 0 or cfg.train.grad_accum < 0:
        raise ConfigError("train.global_batch / train.grad_accum: must be >= 0 (0 means derived)")
    if cfg.train.memory_profile_at < 0:
        raise ConfigError(f"train.memory_profile_at: must be >= 0 (0: off), got {cfg.train.memory_profile_at}")
    if not 0 <= cfg.train.seed < 2 ** 63:  # numpy's generators refuse a negative seed, jax's keys a wider one
        raise ConfigError(f"train.seed: must be in [0, 2**63), got {cfg.train.seed}")


def _in_range(key: str, value, low: float, high: float = math.inf, *, low_open: bool = False,
              high_open: bool = True) -> None:
    """value lies in the interval [low, high) (brackets as the flags say); NaN never does."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below) or math.isnan(value):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ConfigError(f"optimizer.{key}: must be in {interval}, got {value}")


def check_optimizer(cfg: Config) -> None:
    """AdamW's settings in their mathematical ranges: outside them a run trains to NaN or silently diverges.
    clip_norm <= 0 is allowed (it means no clipping)."""
    o = cfg.optimizer
    _in_range("lr", o.lr, 0)
    for key in ("b1", "b2"):
        _in_range(key, getattr(o, key), 0, 1)
    _in_range("eps", o.eps, 0, low_open=True)
    _in_range("weight_decay", o.weight_decay, 0)
    _in_range("min_lr_ratio", o.min_lr_ratio, 0, 1, high_open=False)
    for key in ("warmup_steps", "decay_steps"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optimizer.{key}: must be >= 0, got {getattr(o, key)}")
    if math.isnan(o.clip_norm):
        raise ConfigError("optimizer.clip_norm: must be a number (<= 0: no clipping), got nan")


def check_parallel(cfg: Config) -> None:
    for k in ("dp", "fsdp", "sp", "tp"):  # ep: the mixture of experts' rules
        v = getattr(cfg.parallel, k)
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k}: must be a positive size or -1 (fill), got {v}")
    if [cfg.parallel.dp, cfg.parallel.fsdp, cfg.parallel.sp, cfg.parallel.tp].count(-1) > 1:
        raise ConfigError("parallel: at most one of dp, fsdp, sp, tp may be -1 (fill)")
    if cfg.parallel.pp < 1:
        raise ConfigError(f"parallel.pp: must be >= 1 stages, got {cfg.parallel.pp}")


def check_precision(cfg: Config) -> None:
    p = cfg.precision
    if p.loss_scale.enabled and p.compute_dtype != "float16":
        raise ConfigError("precision.loss_scale.enabled: loss scaling is for compute_dtype=float16 only")
    if p.loss_scale.enabled:
        _check_loss_scale(cfg)
    _check_moments(cfg)
    if p.stochastic_rounding and p.param_dtype != "bfloat16":
        raise ConfigError(f"precision.stochastic_rounding: rounds updates into bfloat16 params; param_dtype is "
                          f"{p.param_dtype}")
    if p.stochastic_rounding and p.master_weights:
        raise ConfigError("precision.stochastic_rounding: the fp32 master already keeps every update; set "
                          "master_weights=false to round into the bf16 params instead")


def _check_loss_scale(cfg: Config) -> None:
    """Dynamic loss scaling's numbers: a positive finite scale and floor, growth >= 1, backoff in (0, 1) (else
    the scale never backs off from an overflow, or turns 0 or negative)."""
    ls = cfg.precision.loss_scale
    ranges = {"init_scale": (0, math.inf, "> 0"), "min_scale": (0, math.inf, "> 0"),
              "growth_factor": (1, math.inf, ">= 1"), "backoff_factor": (0, 1, "in (0, 1)")}
    for key, (low, high, allowed) in ranges.items():
        value = getattr(ls, key)
        inside = (value >= low if key == "growth_factor" else value > low) and (value < high)
        if not (math.isfinite(value) and inside):
            raise ConfigError(f"precision.loss_scale.{key}: must be a finite number {allowed}, got {value}")
    if ls.growth_interval < 1:
        raise ConfigError(f"precision.loss_scale.growth_interval: must be >= 1 steps, got {ls.growth_interval}")


def _check_moments(cfg: Config) -> None:
    """The moments' kind is registered (jaxmem.optim.states), and its own rule holds (its block, Adafactor)."""
    p = cfg.precision
    if p.moment_block < 0:
        raise ConfigError(f"precision.moment_block: must be >= 0 (0: the default block), got {p.moment_block}")
    rule = check_choice("precision.moment_dtype", p.moment_dtype, "jaxmem.optim.states")
    if rule is not None:
        rule(cfg)


def check_data(cfg: Config) -> None:
    """Settings only: whether the files exist is checked when a run reads them (check_data_files), so
    plans, explain and sweep never need the data."""
    d = cfg.data
    if d.kind != "synthetic" and not d.path:
        raise ConfigError(f"data.path: required for data.kind={d.kind}")
    if d.kind in RECORD_KINDS and not d.tokenizer:
        raise ConfigError(f"data.tokenizer: required for data.kind={d.kind} (a tokenizer.json)")
    if d.kind not in RECORD_KINDS and d.format != "text":
        raise ConfigError(f"data.format: {d.format} needs records; set data.kind to one of {', '.join(RECORD_KINDS)}")
    if d.workers < 0:
        raise ConfigError(f"data.workers: must be >= 0 (0: one per CPU core), got {d.workers}")
    for name, role in (d.roles or {}).items():
        if role not in CHAT_ROLES:
            raise ConfigError(f"data.roles: maps {name!r} to {role!r}; map each role name to one of "
                              f"{', '.join(CHAT_ROLES)}")
    e = cfg.eval
    if e.path and d.kind == "synthetic":
        raise ConfigError("eval.path: held-out data needs a file-based data.kind (text, bin, jsonl, parquet, hf)")
    if e.every < 0 or e.batches < 1:
        raise ConfigError(f"eval.every must be >= 0 and eval.batches >= 1, got {e.every} and {e.batches}")


def check_checkpoint(cfg: Config) -> None:
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep < 1:
        raise ConfigError("checkpoint.every must be >= 0 and checkpoint.keep >= 1")
    minutes = cfg.checkpoint.every_minutes
    if not (isinstance(minutes, (int, float)) and minutes >= 0 and minutes != float("inf")):
        raise ConfigError(f"checkpoint.every_minutes: must be a number >= 0 (0: off), got {minutes!r}")


def check_distributed(d: DistributedConfig) -> None:
    """An explicit process group is complete: coordinator HOST:PORT, the process count, this process's id.
    (jaxmem.runtime.distributed.init_settings runs it too, for a DistributedConfig built in code.)"""
    if d.coordinator:
        if d.num_processes < 1:
            raise ConfigError("distributed.num_processes: must be >= 1 when distributed.coordinator is set")
        if not 0 <= d.process_id < d.num_processes:
            raise ConfigError(f"distributed.process_id: {d.process_id} is not in [0, "
                              f"distributed.num_processes={d.num_processes})")
        if ":" not in d.coordinator:
            raise ConfigError(f"distributed.coordinator: {d.coordinator!r} must be HOST:PORT")
    elif d.num_processes > 1 or d.process_id >= 0:
        raise ConfigError("distributed.coordinator: required (HOST:PORT) with distributed.num_processes/process_id")


def check_target(cfg: Config) -> None:
    t = cfg.target
    if not 0 <= t.headroom < 1:
        raise ConfigError(f"target.headroom: must be in [0, 1), got {t.headroom}")
    check_hosts(t.hosts)
    if t.gpus_per_host < 0:
        raise ConfigError(f"target.gpus_per_host: must be >= 0 (0: from the mesh size), got {t.gpus_per_host}")
    if t.host_ram_gb < 0 or not math.isfinite(t.host_ram_gb):
        raise ConfigError(f"target.host_ram_gb: must be a finite number >= 0 (0: the target's default), got "
                          f"{t.host_ram_gb}")
    if t.name:
        get_target(t.name)  # "target.name: ... is unknown; use one of ..."


def require_out_dir(out_dir: str) -> None:
    if not str(out_dir).strip():
        raise ConfigError("out_dir: empty; name the folder for the run's outputs (e.g. out_dir=runs/NAME)")


def seq_len_fits_model(cfg: Config) -> None:
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len: {cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")


def fixed_mesh_size(par: ParallelConfig) -> int | None:
    """pp * dp * fsdp * ep * sp * tp (every device of the run), or None when an axis is -1 (filled from the
    device count)."""
    sizes = (par.dp, par.fsdp, par.ep, par.sp, par.tp)
    return None if -1 in sizes else math.prod(sizes) * par.pp


def batch_layout(cfg: Config, data_ways: int) -> tuple[int, int]:
    """(grad_accum, micro-batch rows per step across all data ways)."""
    t = cfg.train
    rows = t.micro_batch * data_ways
    if t.global_batch and t.grad_accum:
        if t.global_batch != rows * t.grad_accum:
            raise ConfigError(f"train.global_batch: {t.global_batch} != micro_batch {t.micro_batch} x data ways "
                              f"{data_ways} x grad_accum {t.grad_accum}; give one of global_batch or grad_accum")
        return t.grad_accum, rows
    if t.global_batch:
        if t.global_batch % rows:
            raise ConfigError(f"train.global_batch: {t.global_batch} is not a multiple of micro_batch "
                              f"{t.micro_batch} x data ways {data_ways} = {rows}")
        return t.global_batch // rows, rows
    return (t.grad_accum or 1), rows


def check_hosts(hosts: int) -> None:
    if hosts < 1:
        raise ConfigError(f"target.hosts: must be >= 1, got {hosts}")


def per_host_from_mesh(cfg: Config, name: str, hosts: int, attached: Callable[[], int]) -> int:
    """GPUs per host when neither the config nor a flag gives them: the mesh size over the hosts
    (`attached()`: the attached device count, for a -1 mesh axis without a named target)."""
    mesh = fixed_mesh_size(cfg.parallel)
    if mesh is None and name:
        raise ConfigError("target.gpus_per_host: required when the parallel mesh has a -1 (fill) axis; "
                          "set target.gpus_per_host or pass --gpus-per-host")
    if mesh is None:
        mesh = attached()
    if mesh % hosts:
        raise ConfigError(f"target.hosts: {hosts} does not divide the mesh size {mesh}")
    return mesh // hosts


def check_topology(cfg: Config, gpus_per_host: int, n_devices: int, label: str) -> None:
    """The resolved topology (flags over config) can hold the config's mesh."""
    if gpus_per_host < 1:
        raise ConfigError(f"target.gpus_per_host: must be >= 1, got {gpus_per_host}")
    mesh = fixed_mesh_size(cfg.parallel)
    if mesh is not None and mesh != n_devices:
        raise ConfigError(f"parallel: pp*dp*fsdp*ep*sp*tp={mesh} != {n_devices} devices of {label}")
