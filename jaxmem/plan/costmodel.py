"""Cost model: model FLOPs per step (with recompute counted), estimated step time and MFU.

Every figure here is an estimate. The step time adds the device's serial work, each part at its own
achieved rate:
  matmuls      projection + MLP FLOPs (with remat recompute) / (peak x MATMUL_EFFICIENCY); a mixture of
               experts' expert FLOPs (the k active experts') / (peak x grouped_matmul_efficiency: by kernel,
               rows per expert and widths)
  attention    the FLOPs the kernel runs: causal (half of unmasked; the window's band on sliding-window
               layers) for the flash kernels, whose backward
               redoes the score matmuls (fwd + bwd = 3.5 x fwd), plus the forward rerun when the remat
               policy cannot keep its softmax statistics; / (peak x ATTENTION_EFFICIENCY[kernel])
  loss         LM head + cross-entropy: 4 matmul passes for the chunked / fused kernels (the backward
               recomputes the logits), 3 for naive; / (peak x LOSS_EFFICIENCY[kernel])
  memory-bound norms, RoPE, SiLU, residual adds (read + write per layer, again for the recomputed forward)
               and the optimizer update on the device: bytes / (HBM bandwidth x HBM_EFFICIENCY)
  per layer    LAYER_OVERHEAD_SECONDS per decoder layer per micro-batch (kernel launches, scan slicing)
Collectives and host transfers that run inside the forward/backward (FSDP gathers, fetched host weights,
offloaded layer inputs) overlap with compute (step = max of them); the optimizer state streamed through
the device when it lives on the host (update on device) moves after the backward, serially, and adds; an
update run on the host (offload.optimizer_update=host) adds its CPU time: the state kind's host_update_rate
(jaxmem.optim.states).
Host bytes are counted as they cross the link: master, m and v in AND out, grads, fetched weights.

Fitting (benchmarks/calibration/h100_measured.json, benchmarks/costmodel.md): the per-kernel
efficiencies come from the kernel timings alone; MATMUL_EFFICIENCY, HBM_EFFICIENCY and LAYER_OVERHEAD_SECONDS
were then fitted to the non-offload train steps, HOST_LINK_EFFICIENCY was checked (not fitted) on the
offload row (benchmarks/constants.md, costmodel). Model FLOPs (and MFU) keep their convention: 6 x matmul
params x tokens + attention counted unmasked (LoRA: 4 x the frozen matmul params, forward and input
gradient, + 6 x the adapter params); only the time uses what the kernels do.
"""
from __future__ import annotations

import dataclasses
import math

from jaxmem import registry
from jaxmem.core import remat
from jaxmem.config.schema import Config
from jaxmem.config.names import CheckpointName as CN
from jaxmem.model.presets import active_param_count, param_count
from jaxmem.plan.bill import Bill
from jaxmem.model.seq_tiling import tile_count
from jaxmem.mesh.sharding import batch_ways
from jaxmem.config.targets import GpuTarget
from jaxmem.kernels.attention.pallas import score_pairs
from jaxmem.kernels import loss_blocks
from jaxmem.kernels.cross_entropy.chunked import tiles
from jaxmem.core.accounting import state_elems as _state_elems
from jaxmem.optim import states

# MATMUL_EFFICIENCY (projection / MLP matmuls, fraction of the dense peak), HBM_EFFICIENCY (memory-bound
# work: norms, RoPE, SiLU, residual adds, the AdamW update; fraction of HBM bandwidth) and
# LAYER_OVERHEAD_SECONDS (per decoder layer per micro-batch, forward + backward: kernel launches, the layer
# scan's weight slicing and gradient stacking) were fitted together, by least squares on log(estimate /
# measured), to the non-offload rows of benchmarks/calibration/h100_measured.json. The fit is flat along
# matmul vs HBM efficiency, so both stay equal; the per-layer cost is what the data does pin down (the fit:
# benchmarks/costmodel.md; benchmarks/constants.md, costmodel).
MATMUL_EFFICIENCY = 0.7
HBM_EFFICIENCY = 0.7
LAYER_OVERHEAD_SECONDS = 2.0e-3
# Achieved fraction of the dense peak per attention kernel, on the FLOPs the kernel runs (causal,
# fwd + bwd = 3.5 x fwd): the geometric mean of the rates timed at two sequence lengths (benchmarks/
# kernels.md; benchmarks/constants.md, costmodel). xla (plain attention, S x S scores, runs unmasked): not
# measurable there (out of memory), assumed as a plain matmul plus the scores' HBM traffic.
ATTENTION_EFFICIENCY = {"pallas": 0.346, "cudnn": 0.511}
# LM head + cross-entropy per kernel, on the matmul passes it runs (naive 3, others 4), from the kernels'
# timings (benchmarks/kernels.md; benchmarks/constants.md, costmodel).
LOSS_EFFICIENCY = {"naive": 0.339, "chunked": 0.396, "pallas": 0.557}
LOSS_PASSES = {"naive": 3, "chunked": 4, "pallas": 4}
# The chunked loss's rate per (tokens, vocab) tile, from the tile sweep at the same shape (benchmarks/
# constants.md, costmodel). Other tiles: the nearest one.
CHUNKED_LOSS_EFFICIENCY_BY_TILE = {(1024, 4096): 0.396, (2048, 8192): 0.483, (4096, 4096): 0.480,
                                   (8192, 2048): 0.535}
# Achieved fraction of the target's host-link figure (GpuTarget.host_link_bandwidth, already a practical
# per-direction figure); transfers in the two directions are counted one after the other. Not fitted: checked
# against one measured offload step (benchmarks/constants.md, costmodel).
HOST_LINK_EFFICIENCY = 1.0

# The optimizer update on the host CPU (offload.optimizer_update=host), serial after the backward, per trained
# parameter: each optimizer state kind's estimated rate (jaxmem.optim.states, StateKind.host_update_seconds_per_param).
# The layer-scan update the whole one replaced (jaxmem.optim.layerwise.layerwise_update under host compute): the
# step time one measured run added over the model without this term, over its parameters (benchmarks/bench_h200/
# run7; benchmarks/constants.md, costmodel). The cost model prices the cases measured with it
# (benchmarks/calibration: "host_update": "layer_scan") at this rate.
LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM = 12.71 / 2_351_776_512


# One layer's forward as a graph: value -> (producer, its inputs). Recompute walks it back to saved values.
_GRAPH = {
    CN.ATTN_NORM: ("norm", (CN.LAYER_INPUT,)),
    CN.QUERY_PROJ: ("q_proj", (CN.ATTN_NORM,)),
    CN.KEY_PROJ: ("kv_proj", (CN.ATTN_NORM,)),
    CN.VALUE_PROJ: ("kv_proj", (CN.ATTN_NORM,)),
    CN.ATTN_CONTEXT: ("attention", (CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ)),
    CN.ATTN_OUT: ("o_proj", (CN.ATTN_CONTEXT,)),
    CN.MLP_NORM: ("norm", (CN.LAYER_INPUT, CN.ATTN_OUT)),
    CN.MLP_GATE: ("up_proj", (CN.MLP_NORM,)),
    CN.MLP_UP: ("up_proj", (CN.MLP_NORM,)),
    CN.MLP_ACT: ("elementwise", (CN.MLP_GATE, CN.MLP_UP)),
    CN.MLP_OUT: ("down_proj", (CN.MLP_ACT,)),
}
# Values the backward reads (matmul and nonlinearity inputs).
_NEEDED = (CN.ATTN_NORM, CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ, CN.ATTN_CONTEXT, CN.MLP_NORM, CN.MLP_GATE,
           CN.MLP_UP, CN.MLP_ACT)
# Flash kernels whose softmax statistics (logsumexp) carry no checkpoint name: a names-based policy cannot
# keep them, so the forward kernel reruns in the backward (benchmarks/remat.md shows it for pallas; cudnn's
# custom call residuals are unnamed the same way).
_RERUN_KERNELS = ("pallas", "cudnn")
# The matmuls inside the per-token parts of a layer (jaxmem.model.seq_tiling): q, k, v, the output projection,
# gate, up and down.
_TILED_OPS = ["q_proj", "kv_proj", "kv_proj", "o_proj", "up_proj", "up_proj", "down_proj"]


@dataclasses.dataclass
class Cost:
    params: int
    model_flops: float  # 6 N T (LoRA: 4 N T + 6 N_adapters T) + attention (unmasked), per step, all devices
    hardware_flops: float  # model FLOPs + recomputed forward FLOPs + a feature's own passes (a reference forward)
    recompute_flops: float
    compute_seconds: float  # the device's serial work: matmuls + attention + loss + memory-bound + per layer
    collective_seconds: float
    host_link_seconds: float  # every byte over the host link (both directions, one after the other)
    step_seconds: float
    mfu: float
    tokens_per_step: int
    breakdown: dict = dataclasses.field(default_factory=dict)  # seconds per compute part, host bytes
    # the serial host work: the optimizer state streamed over the link (host_link_seconds' part that does not
    # overlap) or the update run on the host CPU
    serial_host_seconds: float = 0.0

    def to_json(self) -> dict:
        out = {k: (float(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}
        out["label"] = "estimated (cost model)"
        out["matmul_efficiency_assumed"] = MATMUL_EFFICIENCY
        # compute overlaps collectives and in-step host transfers (step = their max); the optimizer
        # state streamed through the device after the backward, or the host's update, adds (serial_host_seconds)
        out["overlap_assumed"] = "perfect"
        out["constants"] = {"matmul_efficiency": MATMUL_EFFICIENCY, "hbm_efficiency": HBM_EFFICIENCY,
                            "layer_overhead_seconds": LAYER_OVERHEAD_SECONDS,
                            "attention_efficiency": dict(ATTENTION_EFFICIENCY),
                            "loss_efficiency": dict(LOSS_EFFICIENCY),
                            **{k: v for f in registry.FEATURES for k, v in f.cost_constants.items()},
                            "chunked_loss_efficiency_by_tile": {f"{t}x{v}": e for (t, v), e
                                                                in CHUNKED_LOSS_EFFICIENCY_BY_TILE.items()},
                            "host_link_efficiency": HOST_LINK_EFFICIENCY,
                            "host_update_seconds_per_param": states.host_update_rates(),
                            "fitted_on": "benchmarks/calibration/h100_measured.json"}
        return out


def _local_layers(m) -> int:
    """Sliding-window layers of model `m` (model.sliding_window, model.global_every)."""
    if not m.sliding_window:
        return 0
    return m.n_layers - (m.n_layers // m.global_every if m.global_every else 0)


def _keys_per_query(cfg: Config) -> float:
    """Keys a query scores, averaged over the layers, unmasked convention: S on a global layer, the window
    (at most S) on a local one."""
    m, s = cfg.model, cfg.train.seq_len
    local = _local_layers(m)
    return (local * min(m.sliding_window or s, s) + (m.n_layers - local) * s) / m.n_layers


def _flash_attention_fwd(cfg: Config, tokens: int) -> float:
    """Forward FLOPs a flash kernel runs per layer (averaged over the layers): the causal triangle, or the
    window's band on a local layer (the kernels skip the blocks outside it)."""
    m, s = cfg.model, cfg.train.seq_len
    local = _local_layers(m)
    pairs = (local * score_pairs(s, s, window=m.sliding_window or None) + (m.n_layers - local) * score_pairs(s, s))
    return 4.0 * (tokens / s) * m.n_heads * m.head_dim * pairs / m.n_layers


def _op_flops(cfg: Config, tokens: int) -> dict[str, float]:
    """Forward FLOPs of one layer's ops over `tokens` tokens (all devices); attention unmasked (over the
    window on local layers, averaged over the layers)."""
    m = cfg.model
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    ops = {"norm": 0.0, "elementwise": 0.0, "q_proj": 2.0 * tokens * d * n * h,
           "kv_proj": 2.0 * tokens * d * k * h, "attention": 4.0 * tokens * _keys_per_query(cfg) * n * h,
           "o_proj": 2.0 * tokens * n * h * d, "up_proj": 2.0 * tokens * d * f, "down_proj": 2.0 * tokens * f * d}
    return registry.for_config(cfg).layer_flops(cfg, tokens, ops)  # a mixture of experts: the k it runs


def _rebuilt_ops(cfg: Config, saved: dict[str, str] | None, attention_kernel: str | None,
                 n_tiles: int = 1) -> list[str]:
    """The forward ops one layer's backward runs again (one entry per op run), per the remat policy; with
    sequence tiles (`n_tiles` > 1) the tiled ops once more (each tile reruns its forward in the backward)."""
    ops = _policy_rebuilt_ops(cfg, saved, attention_kernel)
    return ops + _TILED_OPS if n_tiles > 1 else ops


def _policy_rebuilt_ops(cfg: Config, saved: dict[str, str] | None, attention_kernel: str | None) -> list[str]:
    if not remat.uses_checkpoint(cfg.remat):
        return []
    where = saved or remat.saved_across_backward(cfg.remat, fused_attention=True)
    kept = attention_kernel == "pallas" and where[CN.FLASH_RESIDUALS.value] == "device"  # cuDNN's are unnamed
    done: set = {CN.ATTN_CONTEXT} if kept else set()  # the kept kernel output is the context
    ops: list[str] = []

    def rebuild(value) -> None:
        if value == CN.LAYER_INPUT or where[value.value] != "remat" or value in done:
            return
        done.add(value)
        op, inputs = _GRAPH[value]
        ops.append(op)
        for v in inputs:
            rebuild(v)

    for v in _NEEDED:
        rebuild(v)
    if attention_kernel in _RERUN_KERNELS and CN.ATTN_CONTEXT not in done:
        ops.append("attention")  # the flash forward reruns to rebuild its logsumexp residual
    return ops


def recompute_flops_per_layer(cfg: Config, tokens: int, saved: dict[str, str] | None = None,
                              attention_kernel: str | None = None, n_tiles: int = 1) -> float:
    """Forward FLOPs the backward spends to rebuild values the remat policy did not keep (`saved`: a
    layout's per-name placement; default: with the GPU's fused attention).

    Norms, RoPE and SiLU count 0 FLOPs here (matmul FLOPs only, like model FLOPs), so a policy that keeps
    every matmul output (`selective`, `dots`) recomputes 0 matmul FLOPs, except that with a flash kernel
    (`attention_kernel="pallas"` or `"cudnn"`) the attention forward runs again in the backward: its
    logsumexp residual carries no checkpoint name, so no names-based policy keeps it (benchmarks/remat.md).
    Attention is counted unmasked (4 T S N H), as in the model FLOPs. With sequence tiling (`n_tiles` > 1)
    the per-token matmuls run once more.
    """
    ops = _op_flops(cfg, tokens)
    return sum(ops[op] for op in _rebuilt_ops(cfg, saved, attention_kernel, n_tiles))


def _elementwise_elems_per_token(cfg: Config) -> int:
    """Elements one layer's forward reads + writes in its non-matmul ops, per token: two RMSNorms (read d,
    write d; four with post-norms), RoPE on q and k (read + write; the q/k norms as much again), two residual
    adds (read 2 d, write d), SiLU (or GELU) x up (read 2 f, write f)."""
    m = cfg.model
    d, q, kv = m.d_model, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    f = registry.for_config(cfg).mlp_width_per_token(cfg, m.d_ff)  # a mixture of experts: a token's k experts'
    norms = 4 if m.post_norms else 2
    return norms * 2 * d + 2 * (q + kv) * (2 if m.qk_norm else 1) + 2 * 3 * d + 3 * f


def loss_efficiency(cfg: Config, kernel: str, tokens_per_device: int) -> float:
    """Achieved fraction of peak of the LM head + CE kernel; the chunked one by its (resolved) tile."""
    if kernel != "chunked":
        return LOSS_EFFICIENCY.get(kernel, LOSS_EFFICIENCY["chunked"])
    bt, bv = tiles(tokens_per_device, cfg.model.vocab_size, loss_blocks(cfg.kernels))
    if (bt, bv) in CHUNKED_LOSS_EFFICIENCY_BY_TILE:
        return CHUNKED_LOSS_EFFICIENCY_BY_TILE[(bt, bv)]
    near = min(CHUNKED_LOSS_EFFICIENCY_BY_TILE,
               key=lambda tile: abs(math.log2(tile[0] / bt)) + abs(math.log2(tile[1] / bv)))
    return CHUNKED_LOSS_EFFICIENCY_BY_TILE[near]


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(dtype), 4)


def _opt_elems(bill: Bill) -> int:
    """Per-device parameters the optimizer updates (the master / moment shards)."""
    return _state_elems(bill.layout, bill.layout.opt_specs)


def _layer_elems(bill: Bill, specs) -> int:
    return _state_elems(bill.layout, specs, "layers")


def time_breakdown(cfg: Config, bill: Bill, gpu: GpuTarget, n_devices: int, grad_accum: int, rows: int,
                   host_update_rate: float | None = None) -> dict:
    """Seconds per part of one step on one device of `gpu`, and the host-link bytes (per device). `host_update_rate`:
    seconds per parameter of an update on the host (default: the state's host_update_seconds_per_param)."""
    seq = cfg.train.seq_len
    tokens = grad_accum * rows * seq
    peak = gpu.peak_flops(cfg.precision.compute_dtype)
    kernels = bill.layout.kernels
    attn_kernel, loss_kernel = kernels.get("attention", "xla"), kernels.get("loss", "chunked")
    ops = _op_flops(cfg, tokens)
    # the tiles rerun their forward in the backward: counted here as in the recompute FLOPs
    rebuilt = _rebuilt_ops(cfg, bill.layout.saved, attn_kernel,
                           tile_count(seq, bill.mesh.get("sp", 1), cfg.remat.seq_tile))
    matmul_s, matmul_flops, own_rate = _matmul_seconds(cfg, bill, ops, rebuilt, tokens, n_devices * peak)
    attn_s, attn_flops = _attention_seconds(cfg, gpu, attn_kernel, rebuilt, tokens, grad_accum * rows,
                                            n_devices, peak)
    loss_s, loss_flops = _loss_seconds(cfg, loss_kernel, tokens, n_devices, peak, bill.layout.freezes_model)
    memory_s, hbm_bytes = _memory_seconds(cfg, bill, gpu, tokens, n_devices)
    layer_s = LAYER_OVERHEAD_SECONDS * cfg.model.n_layers * grad_accum
    extra_flops = _extra_step_flops(cfg, tokens)  # a feature's own passes (a preference reference's forward)
    extra_s = extra_flops / (n_devices * peak * MATMUL_EFFICIENCY)
    overlapped, serial = _host_link_bytes(cfg, bill, grad_accum)
    link = gpu.host_link_bandwidth * HOST_LINK_EFFICIENCY
    homes = bill.layout.homes
    rate = bill.layout.optimizer.host_update_seconds_per_param if host_update_rate is None else host_update_rate
    host_update_s = _opt_elems(bill) * rate if homes.update_on_host else 0.0
    compute_s = matmul_s + attn_s + loss_s + memory_s + layer_s + extra_s
    return {"matmul_seconds": matmul_s, "attention_seconds": attn_s, "loss_seconds": loss_s,
            "memory_bound_seconds": memory_s, "layer_overhead_seconds": layer_s, "extra_seconds": extra_s,
            "extra_flops": extra_flops, "compute_seconds": compute_s,
            "host_bytes_overlapped": float(overlapped), "host_bytes_serial": float(serial),
            "host_overlapped_seconds": overlapped / link, "host_serial_seconds": serial / link,
            "host_update_seconds": host_update_s,
            "matmul_flops": matmul_flops, **_breakdown_defaults(), "attention_kernel_flops": attn_flops,
            "loss_flops": loss_flops, "hbm_bytes": hbm_bytes, "attention_kernel": attn_kernel,
            "loss_kernel": loss_kernel, **own_rate}


def forward_flops(cfg: Config, tokens: int) -> float:
    """One forward of the whole model over `tokens` tokens: 2 FLOPs per matmul weight and token (the LM head
    included, not the embedding lookup) plus the unmasked attention forward, as model_flops counts them."""
    m = cfg.model
    matmul_params = active_param_count(m) - m.vocab_size * m.d_model * (0 if m.tie_embeddings else 1)
    return 2.0 * matmul_params * tokens + _op_flops(cfg, tokens)["attention"] * m.n_layers


def _extra_step_flops(cfg: Config, tokens: int) -> float:
    """What the active features run per step beside the trained forward and backward (Feature.extra_step_flops)."""
    return registry.for_config(cfg).extra_step_flops(cfg, forward_flops(cfg, tokens))


def _breakdown_defaults() -> dict:
    """What the breakdown reports of every feature the registry holds, on or off (a dense model's 0 expert FLOPs)."""
    return {k: v for f in registry.FEATURES for k, v in f.cost_breakdown_defaults.items()}


def _matmul_seconds(cfg: Config, bill: Bill, ops: dict, rebuilt: list[str], tokens: int,
                    peak_all: float) -> tuple[float, float, dict]:
    """(seconds, FLOPs, the breakdown entries of those a feature runs at its own rate) of the projection / MLP
    matmuls: forward, backward (2 x; a frozen weight's 1 x, its input gradient), the remat recompute. A feature
    may run some at its kernel's own rate (a mixture of experts' grouped matmuls)."""
    m = cfg.model
    features = registry.for_config(cfg)
    weight_passes = 2 if bill.layout.freezes_model else 3
    layer_matmul = sum(v for k, v in ops.items() if k.endswith("_proj"))
    layer_matmul += ops["up_proj"] + ops["kv_proj"]  # gate + up, key + value: two matmuls each
    recomputed = sum(ops[o] for o in rebuilt if o.endswith("_proj"))
    matmul_flops = (weight_passes * layer_matmul + recomputed) * m.n_layers
    own = features.own_rate_matmuls(cfg, bill, ops, rebuilt, weight_passes)
    extra = features.extra_trained_params(cfg)
    if extra:  # what a feature trains beside the model (LoRA's adapters): forward, dx, dA, dB
        matmul_flops += 3 * 2.0 * tokens * extra
    own_flops = sum(flops for flops, _, _ in own)
    seconds = ((matmul_flops - own_flops) / MATMUL_EFFICIENCY + sum(flops / rate for flops, rate, _ in own)) / peak_all
    return seconds, matmul_flops, {k: v for _, _, entries in own for k, v in entries.items()}


def _attention_seconds(cfg: Config, gpu: GpuTarget, kernel: str, rebuilt: list[str], tokens: int, sequences: int,
                       n_devices: int, peak: float) -> tuple[float, float]:
    """(seconds, FLOPs) of attention as the kernel runs it: a flash kernel over the causal triangle (or a
    window's band); plain XLA unmasked, the [N, T, S] scores written and read ~6 times."""
    m, seq = cfg.model, cfg.train.seq_len
    reruns = rebuilt.count("attention")
    if kernel in ATTENTION_EFFICIENCY:
        causal_fwd = _flash_attention_fwd(cfg, tokens)  # ops["attention"] / 2 without a window
        flops = causal_fwd * (3.5 + reruns) * m.n_layers
        return flops / (n_devices * peak * ATTENTION_EFFICIENCY[kernel]), flops
    flops = 4.0 * tokens * seq * m.n_heads * m.head_dim * (3 + reruns) * m.n_layers
    scores = sequences * m.n_heads * seq * seq * 4 * 6 * (1 + reruns / 3) * m.n_layers
    hbm = gpu.hbm_bandwidth * HBM_EFFICIENCY
    return flops / (n_devices * peak * MATMUL_EFFICIENCY) + scores / (n_devices * hbm), flops


def _loss_seconds(cfg: Config, kernel: str, tokens: int, n_devices: int, peak: float,
                  frozen_head: bool) -> tuple[float, float]:
    """(seconds, FLOPs) of the LM head + cross-entropy; a frozen head (the model frozen: LoRA) has no dW."""
    m = cfg.model
    passes = LOSS_PASSES.get(kernel, 4) - (1 if frozen_head else 0)
    flops = passes * 2.0 * tokens * m.d_model * m.vocab_size
    return flops / (n_devices * peak * loss_efficiency(cfg, kernel, max(1, tokens // n_devices))), flops


def _memory_seconds(cfg: Config, bill: Bill, gpu: GpuTarget, tokens: int, n_devices: int) -> tuple[float, float]:
    """(seconds, bytes) memory-bound: elementwise forward + backward (2 x) + the recomputed forward, and the
    update: grads read twice (global norm, update), old params read, master / m / v read + written, params
    written. The default step holds most gradients at the params' dtype (jaxmem.core.grad_dtype): the bill's."""
    m, p = cfg.model, cfg.precision
    passes = 3 + (1 if remat.uses_checkpoint(cfg.remat) else 0)
    elementwise_bytes = _elementwise_elems_per_token(cfg) * _itemsize(p.compute_dtype) * passes * tokens \
        * m.n_layers / n_devices
    opt_elems = _opt_elems(bill)
    grad_b, param_b = _itemsize(p.grad_reduce_dtype), _itemsize(p.param_dtype)
    moments_b = sum(bill.layout.optimizer.moment_bytes_per_value())  # m + v as stored (optim.kind)
    master_b = 4 if p.master_weights else 0
    homes = bill.layout.homes
    plain = bill.whole_model_grads and not homes.params_on_host  # the bill's grads are what the update reads
    grad_read = bill.device["grads"] if plain else opt_elems * grad_b
    update_bytes = 2 * grad_read + opt_elems * (2 * param_b + 2 * master_b + 2 * moments_b)
    hbm = gpu.hbm_bandwidth * HBM_EFFICIENCY
    return (elementwise_bytes + (0 if homes.update_on_host else update_bytes)) / hbm, elementwise_bytes + update_bytes


def _host_link_bytes(cfg: Config, bill: Bill, grad_accum: int) -> tuple[float, float]:
    """(overlapped, serial) bytes per device that cross the host link: offloaded layer inputs out and back
    in, host-resident layers' weights in (forward, backward) and their gradients out, and the optimizer state
    streamed through the device after the backward (or the gradients down and new params back for an update
    on the host)."""
    p = cfg.precision
    grad_b, param_b = _itemsize(p.grad_reduce_dtype), _itemsize(p.param_dtype)
    moments_b = sum(bill.layout.optimizer.moment_bytes_per_value())
    master_b = 4 if p.master_weights else 0
    homes = bill.layout.homes
    overlapped = 2 * bill.host.get("activations", 0) * grad_accum
    serial = 0.0
    layer_params = _layer_elems(bill, bill.layout.param_specs)
    if homes.params_on_host:
        overlapped += grad_accum * layer_params * (2 * param_b) + layer_params * grad_b
    if homes.optimizer_on_host:
        opt_elems = _opt_elems(bill)
        if homes.update_streamed:
            serial = 2 * opt_elems * (master_b + moments_b)
            if homes.params_on_host:  # host layer grads in twice (norm, update), old params in, new out
                serial += layer_params * (2 * grad_b + 2 * param_b)
        else:
            serial = bill.device["grads"] + opt_elems * param_b
    return overlapped, serial


def sequence_parallel_seconds(cfg: Config, bill: Bill, gpu: GpuTarget, grad_accum: int) -> float:
    """Ulysses all-to-alls per step: q, k, v and the attention output change split (sequence <-> heads) in
    the forward, again where the backward rebuilds the layer, and their gradients in the backward; each
    moves (sp - 1) / sp of the tensor off the device (estimated, at the interconnect bandwidth)."""
    sp = bill.mesh.get("sp", 1)
    if sp == 1:
        return 0.0
    per_name = bill.per_name
    elems = sum(per_name[n.value] for n in (CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ, CN.ATTN_CONTEXT))
    passes = 3 if bill.layout.checkpointed else 2
    cd = 2 if cfg.precision.compute_dtype != "float32" else 4
    moved = grad_accum * passes * elems * cd * (sp - 1) / sp * cfg.model.n_layers
    return moved / gpu.interconnect_bandwidth


def zero3_gathered_bytes(cfg: Config, bill: Bill, n_params: int) -> float:
    """Bytes of bf16 weights one ZeRO-3 all-gather brings each device per pass over the model: the
    (ways - 1) / ways it does not hold, ways = dp x fsdp x ep (batch_ways) for the non-expert weights and
    dp x fsdp for the experts (split over ep, never gathered over it: a feature's own, Feature.zero3_gathered).
    0 below ZeRO-3."""
    if cfg.parallel.zero_stage != 3:
        return 0.0
    ways = batch_ways(bill.mesh)
    own = registry.for_config(cfg).zero3_gathered(cfg, bill)
    rest = n_params - sum(elems for elems, _ in own)
    return rest * 2 / bill.mesh["tp"] * ((ways - 1) / ways) + sum(gathered for _, gathered in own)


def estimate(cfg: Config, bill: Bill, gpu: GpuTarget | None, n_devices: int, grad_accum: int,
             rows: int, host_update_rate: float | None = None) -> Cost:
    """Step FLOPs and, for a GPU target, time and MFU (estimated by the cost model); `host_update_rate` as in
    time_breakdown."""
    m = cfg.model
    tokens = grad_accum * rows * cfg.train.seq_len
    n_params = param_count(m)
    # a mixture of experts: a token runs experts_per_token of the experts (6 N_active T), the state holds them all
    matmul_params = active_param_count(m) - m.vocab_size * m.d_model * (0 if m.tie_embeddings else 1)  # no lookup
    layer_ops = _op_flops(cfg, tokens)
    attention = 3.0 * layer_ops["attention"] * m.n_layers
    # a frozen model (LoRA) gets no weight gradient (forward + dx: 4 N T); what a feature trains beside it (the
    # adapters) 6 per element and token
    weight_passes = 4.0 if bill.layout.freezes_model else 6.0
    extra = registry.for_config(cfg).extra_trained_params(cfg)
    model_flops = weight_passes * matmul_params * tokens + 6.0 * extra * tokens + attention
    n_tiles = tile_count(cfg.train.seq_len, bill.mesh.get("sp", 1), cfg.remat.seq_tile)
    recompute = recompute_flops_per_layer(cfg, tokens, bill.layout.saved, bill.layout.kernels.get("attention"),
                                          n_tiles) * m.n_layers
    hardware = model_flops + recompute + _extra_step_flops(cfg, tokens)
    if gpu is None:
        return Cost(n_params, model_flops, hardware, recompute, 0.0, 0.0, 0.0, 0.0, 0.0, tokens)
    peak = gpu.peak_flops(cfg.precision.compute_dtype)
    parts = time_breakdown(cfg, bill, gpu, n_devices, grad_accum, rows, host_update_rate)
    compute = parts["compute_seconds"]
    # ZeRO-3: all-gather weights for forward and backward, reduce-scatter gradients, every micro-batch, over the
    # state axes (dp x fsdp x ep: ep devices hold different tokens, so the state shards over them too). Expert
    # weights split over ep are gathered over the rest only (an ep-th of them per device).
    collective = 3 * grad_accum * zero3_gathered_bytes(cfg, bill, n_params) / gpu.interconnect_bandwidth
    collective += sequence_parallel_seconds(cfg, bill, gpu, grad_accum)
    collective += registry.for_config(cfg).collective_seconds(cfg, bill, gpu, grad_accum)  # expert parallelism's
    host_link = parts["host_overlapped_seconds"] + parts["host_serial_seconds"]
    serial = parts["host_serial_seconds"] + parts["host_update_seconds"]
    step = max(compute, collective, parts["host_overlapped_seconds"]) + serial
    mfu = model_flops / (step * n_devices * peak) if step else 0.0
    return Cost(n_params, model_flops, hardware, recompute, compute, collective, host_link, step, mfu, tokens,
                breakdown=parts, serial_host_seconds=serial)
