"""Loading a run config and every rule it must satisfy, in one pass: `load_config` (public as
`jaxmem.config.load_config`) reads YAML and dotted overrides into the typed schema (`jaxmem.config.schema`), fills
`model.*` from its preset (`jaxmem.model.presets`), then runs each of SECTION_VALIDATORS and CROSS_CHECKS,
so a bad config is a one-line ConfigError at load, before any program is built.

Imports go one way: `jaxmem.config.schema` (dataclasses, ConfigError, YAML, overrides; no other jaxmem import) <-
the modules that own a vocabulary (`jaxmem.model.presets`, `jaxmem.core.remat`, `jaxmem.kernels`,
`jaxmem.config.targets`, `jaxmem.core.offload`) <- this module <- `jaxmem.config` and the callers (`jaxmem.core.program`,
`jaxmem.runtime.aot`, `jaxmem.runtime.distributed`, the CLIs).

The rules that need the device count live here too, as functions called once it is known:
`batch_layout` (jaxmem.core.layout, which program and the bill share) and `check_grad_accum` (build_program),
`per_host_from_mesh` and `check_topology` (jaxmem.runtime.aot.resolve_topology). With a mesh that has no -1 axis
the batch rules already run at load. (Filling a -1 mesh axis is jaxmem.core.sharding.mesh_shape's.)
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Callable

from jaxmem import kernels
from jaxmem.core import remat
from jaxmem.config.schema import (Config, ConfigError, DistributedConfig, NotYetSupported, ParallelConfig,  # noqa: F401
                                  apply_overrides, parse_raw, read_yaml)
from jaxmem.io.documents.reading import RECORD_KINDS
from jaxmem.model.names import ALL_NAMES
from jaxmem.model.presets import check_model, resolve_model
from jaxmem.config.targets import get_target

# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML config (or the defaults), applies dotted overrides, resolves presets and validates."""
    raw = read_yaml(path) if path else {}
    return from_dict(apply_overrides(raw, overrides or []))


def from_dict(raw: dict) -> Config:
    """The validated Config of a raw mapping (as read from YAML, or `jaxmem.config.to_dict`'s output)."""
    cfg = parse_raw(raw)
    cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model, raw.get("model") or {}))
    check(cfg)
    return cfg


def check(cfg: Config) -> None:
    """Every rule that needs only the config; for a Config built or changed in code."""
    for section_rules in SECTION_VALIDATORS.values():
        section_rules(cfg)
    for rule in CROSS_CHECKS:
        rule(cfg)


# ---------------------------------------------------------------- per section


def _positive(key: str, v) -> None:
    if v <= 0:
        raise ConfigError(f"{key}: must be > 0, got {v}")


def _model(cfg: Config) -> None:
    m = cfg.model
    for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "max_seq_len"):
        _positive(f"model.{k}", getattr(m, k))
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} must divide model.n_heads={m.n_heads}")
    check_model(m)
    _moe_levers(cfg)
    if m.embed_scale and cfg.lora.rank and cfg.lora.quantize_embeddings:
        raise ConfigError("lora.quantize_embeddings: not with model.embed_scale (Gemma) yet: the quantized "
                          "embedding lookup does not scale by sqrt(d_model); set it to false")


def _moe_levers(cfg: Config) -> None:
    """Mixture of experts: expert parallelism's sizes, and the levers it does not take yet, by name."""
    m, ep = cfg.model, cfg.parallel.ep
    if ep < 1:
        raise ConfigError(f"parallel.ep: must be a positive size (no -1 fill), got {ep}")
    if ep > 1 and not m.n_experts:
        raise ConfigError(f"parallel.ep: {ep} needs a mixture of experts (model.n_experts > 0); "
                          "use 1 for a dense model")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor: must be >= 0 (0: dropless), got {m.moe_capacity_factor}")
    if not m.n_experts:
        return
    if m.n_experts % ep:
        raise ConfigError(f"model.n_experts: {m.n_experts} experts do not split evenly over parallel.ep={ep}")
    if m.moe_capacity_factor and ep == 1:
        raise NotYetSupported("model.moe_capacity_factor: caps the expert-parallel dispatch only; set "
                              "parallel.ep > 1 or 0 (dropless)")
    if m.moe_capacity_factor and cfg.remat.seq_tile > 0:
        raise NotYetSupported("remat.seq_tile: not with model.moe_capacity_factor > 0 yet (each sequence tile would "
                              "drop by its own capacity); set 0 (dropless) or remat.seq_tile=0")
    if ep > 1:  # the levers tested with a mixture of experts on one device's experts, not yet with ep
        refused = {"lora.rank": cfg.lora.rank > 0, "optimizer.update_in_backward": cfg.optimizer.update_in_backward,
                   "model.moe_biases": m.moe_biases}
        for key, on in refused.items():
            if on:
                raise NotYetSupported(f"{key}: not supported with expert parallelism (parallel.ep={ep}) yet; "
                                      "set parallel.ep=1 (the experts then shard over fsdp)")


def _train(cfg: Config) -> None:
    for k in ("steps", "micro_batch", "seq_len", "log_every"):
        _positive(f"train.{k}", getattr(cfg.train, k))
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


def _optimizer(cfg: Config) -> None:
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


def _parallel(cfg: Config) -> None:
    for k in ("dp", "fsdp", "sp", "tp"):  # ep: _moe_levers
        v = getattr(cfg.parallel, k)
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k}: must be a positive size or -1 (fill), got {v}")
    if [cfg.parallel.dp, cfg.parallel.fsdp, cfg.parallel.sp, cfg.parallel.tp].count(-1) > 1:
        raise ConfigError("parallel: at most one of dp, fsdp, sp, tp may be -1 (fill)")
    if cfg.parallel.pp < 1:
        raise ConfigError(f"parallel.pp: must be >= 1 stages, got {cfg.parallel.pp}")


def _precision(cfg: Config) -> None:
    p = cfg.precision
    if p.loss_scale.enabled and p.compute_dtype != "float16":
        raise ConfigError("precision.loss_scale.enabled: loss scaling is for compute_dtype=float16 only")


def _data(cfg: Config) -> None:
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
    e = cfg.eval
    if e.path and d.kind == "synthetic":
        raise ConfigError("eval.path: held-out data needs a file-based data.kind (text, bin, jsonl, parquet, hf)")
    if e.every < 0 or e.batches < 1:
        raise ConfigError(f"eval.every must be >= 0 and eval.batches >= 1, got {e.every} and {e.batches}")


def check_data_files(cfg: Config) -> None:
    """The data files a run reads exist (one line naming the key); runs call it before anything compiles."""
    d = cfg.data
    for key, path in (("data.path", d.path if d.kind != "synthetic" else ""), ("data.tokenizer", d.tokenizer),
                      ("data.chat_template", d.chat_template), ("eval.path", cfg.eval.path)):
        if path and not Path(path).exists():
            raise ConfigError(f"{key}: file {path} not found")
    if d.kind in ("text", "bin") and d.path and not Path(d.path).is_file():
        raise ConfigError(f"data.path: {d.path} is not a file (data.kind={d.kind} reads one file)")


def _lora(cfg: Config) -> None:
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank: must be >= 0 (0: full fine-tune), got {lo.rank}")
    if lo.rank == 0:
        return
    if lo.alpha <= 0:
        raise ConfigError(f"lora.alpha: must be > 0, got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout: must be in [0, 1), got {lo.dropout}")
    if lo.dropout > 0 and cfg.remat.seq_tile > 0:
        raise ConfigError("lora.dropout: > 0 does not combine with remat.seq_tile yet (each tile would draw the "
                          "same mask); set remat.seq_tile=0 or lora.dropout=0")
    from jaxmem.lora.adapters import resolve_targets

    resolve_targets(lo.targets, model=cfg.model)  # "lora.targets: 'x' is not a target; use some of ..."
    if cfg.optimizer.update_in_backward or cfg.offload.params == "host":
        raise ConfigError("lora.rank: LoRA does not combine with optimizer.update_in_backward or offload.params=host "
                          "yet (the frozen base stays on the device, quantized if you like: lora.base_dtype)")
    par = cfg.parallel
    if lo.quantize_embeddings and (lo.base_dtype == "bfloat16" or cfg.kernels.loss != "chunked"
                                   or max(par.dp, par.fsdp, par.tp, par.sp, par.pp) > 1):
        raise ConfigError("lora.quantize_embeddings: needs lora.base_dtype int8 or nf4, kernels.loss=chunked and one "
                          f"device (got base_dtype={lo.base_dtype}, kernels.loss={cfg.kernels.loss})")


def _checkpoint(cfg: Config) -> None:
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


def _remat(cfg: Config) -> None:
    r = cfg.remat
    if r.preset not in remat.PRESETS:
        raise ConfigError(f"remat.preset: {r.preset!r} is unknown; use one of {', '.join(remat.PRESETS)}")
    for name, choice in r.names.items():
        if name not in ALL_NAMES:
            raise ConfigError(f"remat.names.{name}: unknown checkpoint name; use one of {', '.join(ALL_NAMES)}")
        if choice not in remat.CHOICES:
            raise ConfigError(f"remat.names.{name}: {choice!r} is not allowed; use one of "
                              f"{', '.join(remat.CHOICES)}")
    if r.every_k < 1:
        raise ConfigError(f"remat.every_k: must be >= 1, got {r.every_k}")
    if r.seq_tile < 0:
        raise ConfigError(f"remat.seq_tile: must be >= 0 (0: off), got {r.seq_tile}")


def _offload(cfg: Config) -> None:
    """Lever combinations the step cannot honour (with the grad_accum the config gives; a derived one is
    checked by check_grad_accum)."""
    if cfg.offload.params != "host":
        return
    if not remat.uses_checkpoint(cfg.remat):
        raise ConfigError("offload.params=host: needs a remat preset other than none (layer weights are "
                          "fetched again in the backward pass instead of being kept on the device)")
    if cfg.remat.granularity != "layer":
        raise ConfigError(f"offload.params=host: needs remat.granularity=layer (got {cfg.remat.granularity!r}); "
                          "the per-layer fetch must sit inside the layer's checkpoint")
    check_grad_accum(cfg, cfg.train.grad_accum)


def _target(cfg: Config) -> None:
    t = cfg.target
    if not 0 <= t.headroom < 1:
        raise ConfigError(f"target.headroom: must be in [0, 1), got {t.headroom}")
    check_hosts(t.hosts)
    if t.gpus_per_host < 0:
        raise ConfigError(f"target.gpus_per_host: must be >= 0 (0: from the mesh size), got {t.gpus_per_host}")
    if t.host_ram_gb < 0:
        raise ConfigError(f"target.host_ram_gb: must be >= 0 (0: the target's default), got {t.host_ram_gb}")
    if t.name:
        get_target(t.name)  # "target.name: ... is unknown; use one of ..."


def require_out_dir(out_dir: str) -> None:
    if not str(out_dir).strip():
        raise ConfigError("out_dir: empty; name the folder for the run's outputs (e.g. out_dir=runs/NAME)")


# Each takes the whole Config (a section's rules may read the sections it depends on) and raises a one-line
# ConfigError naming the key. Run in this order (remat before offload: offload reads the remat preset).
SECTION_VALIDATORS: dict[str, Callable[[Config], None]] = {
    "model": _model,
    "train": _train,
    "optimizer": _optimizer,
    "parallel": _parallel,
    "precision": _precision,
    "data": _data,
    "checkpoint": _checkpoint,
    "lora": _lora,
    "distributed": lambda cfg: check_distributed(cfg.distributed),
    "remat": _remat,
    "offload": _offload,
    "kernels": lambda cfg: kernels.check_block_sizes(cfg.kernels),
    "target": _target,
    "out_dir": lambda cfg: require_out_dir(cfg.out_dir),
}


# ---------------------------------------------------------------- across sections (after every section passed)


def _seq_len_fits_model(cfg: Config) -> None:
    if cfg.train.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len: {cfg.train.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")


def _attention_kernel_takes_the_model(cfg: Config) -> None:
    if cfg.model.attention_sinks and cfg.kernels.attention == "cudnn":
        raise ConfigError("kernels.attention: cudnn has no attention sinks (model.attention_sinks, gpt-oss); use "
                          "auto (the Pallas kernel on a GPU), pallas or xla")


def _remat_groups_divide_layers(cfg: Config) -> None:
    remat.group_size(cfg.remat, cfg.model.n_layers)  # "remat.every_k: k does not divide model.n_layers=..."


def _update_in_backward_levers(cfg: Config) -> None:
    """optimizer.update_in_backward rebuilds each layer from its input inside the backward and updates it at
    once: the levers that would change either part are refused here, by name."""
    if not cfg.optimizer.update_in_backward:
        return
    key = "optimizer.update_in_backward"
    if cfg.remat.preset not in ("full", "offload_layer_inputs") or cfg.remat.granularity != "layer" \
            or cfg.remat.names:
        raise ConfigError(f"{key}: needs remat.preset=full or offload_layer_inputs with remat.granularity=layer "
                          "and no remat.names (the backward rebuilds each layer from its input)")
    if cfg.offload.params != "device":
        raise ConfigError(f"{key}: needs offload.params=device (the backward updates device-resident layers)")
    if cfg.offload.optimizer == "host" and cfg.offload.optimizer_update != "device":
        raise ConfigError(f"{key}: with offload.optimizer=host needs offload.optimizer_update=device (each "
                          "layer's state is streamed to the device and back; no host-compute variant)")
    if cfg.precision.loss_scale.enabled:
        raise ConfigError(f"{key}: cannot skip a step after layers were already updated; turn off "
                          "precision.loss_scale (fp16), or use bf16")


def _pipeline_levers(cfg: Config) -> None:
    """parallel.pp: the layer counts per stage, and the levers a pipeline does not take (yet), by name."""
    if cfg.parallel.pp == 1:
        return
    from jaxmem.pipeline.partition import layer_counts

    counts = layer_counts(cfg)  # "parallel.pp_layers: ..." on a bad list
    for k in counts or ():
        remat.group_size(cfg.remat, k)  # every_k groups must divide each stage's layers
    refused = {"lora.rank": cfg.lora.rank > 0, "optimizer.update_in_backward": cfg.optimizer.update_in_backward,
               "precision.loss_scale.enabled": cfg.precision.loss_scale.enabled,
               "offload.params": cfg.offload.params != "device",
               # a stage's layers do not know their number in the whole model, which picks local or global
               "model.global_every": cfg.model.global_every > 0}
    for key, on in refused.items():
        if on:
            raise ConfigError(f"{key}: not supported with parallel.pp > 1 yet; use pp=1 for this lever")


def _batch_fits_fixed_mesh(cfg: Config) -> None:
    """With no -1 mesh axis the data ways are known now: the batch and offload rules run at load."""
    if fixed_mesh_size(cfg.parallel) is not None:
        grad_accum, _ = batch_layout(cfg, cfg.parallel.dp * cfg.parallel.fsdp * cfg.parallel.ep)
        check_grad_accum(cfg, grad_accum)


CROSS_CHECKS: tuple[Callable[[Config], None], ...] = (
    _seq_len_fits_model,  # train vs model
    _remat_groups_divide_layers,  # remat vs model
    _attention_kernel_takes_the_model,  # kernels vs model
    _batch_fits_fixed_mesh,  # train vs parallel, offload vs the derived grad_accum
    _update_in_backward_levers,  # optimizer vs remat, offload, precision
    _pipeline_levers,  # parallel.pp vs model, remat, lora, optimizer, precision, offload
)


# ---------------------------------------------------------------- once the device count is known


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


def check_grad_accum(cfg: Config, grad_accum: int) -> None:
    """Rules on the number of micro-batches per step, given or derived from global_batch and the data ways."""
    if cfg.offload.params == "host" and grad_accum > 1:
        raise ConfigError(f"offload.params=host: needs train.grad_accum=1, got {grad_accum} from train.* "
                          "(gradients land on the host, where they cannot be accumulated)")
    if cfg.optimizer.update_in_backward and grad_accum > 1:
        raise ConfigError(f"optimizer.update_in_backward: needs train.grad_accum=1, got {grad_accum} from "
                          "train.* (each layer is updated as soon as its gradient exists)")


def check_sequence_layout(cfg: Config, sizes: dict[str, int], attention: str) -> None:
    """Sequence parallelism and tiling against the mesh sizes and the attention kernel `auto` resolved to."""
    from jaxmem.kernels.attention.sequence_parallel import heads_divide

    sp, seq, m = sizes.get("sp", 1), cfg.train.seq_len, cfg.model
    if seq % sp:
        raise ConfigError(f"parallel.sp: {sp} does not divide train.seq_len={seq}")
    if sp > 1 and attention != "xla" and not heads_divide(m.n_heads, sizes):
        raise ConfigError(f"parallel.sp: model.n_heads={m.n_heads} does not split over tp x sp = "
                          f"{sizes.get('tp', 1) * sp}; kernels.attention={attention} needs whole heads per "
                          "device (use kernels.attention=xla, which gathers k and v, or an sp that divides them)")
    tile = cfg.remat.seq_tile
    if tile and (seq // sp) % tile:
        raise ConfigError(f"remat.seq_tile: {tile} does not divide the per-device sequence train.seq_len / "
                          f"parallel.sp = {seq // sp}")


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
