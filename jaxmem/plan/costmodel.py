"""Cost model: model FLOPs per step (with recompute counted), estimated step time and MFU.

Every figure here is an estimate: a roofline over the target's published peaks with an assumed
matmul efficiency, perfect overlap of compute with collectives and host transfers.
"""
from __future__ import annotations

import dataclasses

from jaxmem import remat
from jaxmem.schema import Config
from jaxmem.model.names import CheckpointName as CN
from jaxmem.model.presets import param_count
from jaxmem.plan.bill import Bill
from jaxmem.targets import GpuTarget

MATMUL_EFFICIENCY = 0.7  # assumed fraction of the dense bf16 peak a well-tiled matmul reaches

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


@dataclasses.dataclass
class Cost:
    params: int
    model_flops: float  # 6 N T + attention, per step, all devices
    hardware_flops: float  # model FLOPs + recomputed forward FLOPs
    recompute_flops: float
    compute_seconds: float
    collective_seconds: float
    host_link_seconds: float
    step_seconds: float
    mfu: float
    tokens_per_step: int

    def to_json(self) -> dict:
        out = {k: (float(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(self).items()}
        out["label"] = "estimated (cost model)"
        out["matmul_efficiency_assumed"] = MATMUL_EFFICIENCY
        out["overlap_assumed"] = "perfect"  # step = max(compute, collectives, host link), not their sum
        return out


def _op_flops(cfg: Config, tokens: int) -> dict[str, float]:
    """Forward FLOPs of one layer's ops over `tokens` tokens (all devices)."""
    m, s = cfg.model, cfg.train.seq_len
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    return {"norm": 0.0, "elementwise": 0.0, "q_proj": 2.0 * tokens * d * n * h,
            "kv_proj": 2.0 * tokens * d * k * h, "attention": 4.0 * tokens * s * n * h,
            "o_proj": 2.0 * tokens * n * h * d, "up_proj": 2.0 * tokens * d * f, "down_proj": 2.0 * tokens * f * d}


def recompute_flops_per_layer(cfg: Config, tokens: int, saved: dict[str, str] | None = None,
                              attention_kernel: str | None = None) -> float:
    """Forward FLOPs the backward spends to rebuild values the remat policy did not keep (`saved`: a
    layout's per-name placement; default: with the GPU's fused attention).

    Norms, RoPE and SiLU count 0 FLOPs here (matmul FLOPs only, like model FLOPs), so a policy that keeps
    every matmul output (`selective`, `dots`) recomputes 0 matmul FLOPs, except that with the Pallas flash
    kernel (`attention_kernel="pallas"`) the attention forward runs again in the backward: its logsumexp
    residual carries no checkpoint name, so no names-based policy keeps it (benchmarks/remat.md). Attention
    is counted unmasked (4 T S N H), as in the model FLOPs.
    """
    if not remat.uses_checkpoint(cfg.remat):
        return 0.0
    where = saved or remat.saved_across_backward(cfg.remat, fused_attention=True)
    ops = _op_flops(cfg, tokens)
    done: set = set()

    def rebuild(value) -> float:
        if value == CN.LAYER_INPUT or where[value.value] != "remat" or value in done:
            return 0.0
        done.add(value)
        op, inputs = _GRAPH[value]
        return ops[op] + sum(rebuild(v) for v in inputs)

    total = sum(rebuild(v) for v in _NEEDED)
    if attention_kernel == "pallas" and CN.ATTN_CONTEXT not in done:
        total += ops["attention"]  # the flash forward reruns to rebuild its logsumexp residual
    return total


def estimate(cfg: Config, bill: Bill, gpu: GpuTarget | None, n_devices: int, grad_accum: int,
             rows: int) -> Cost:
    """Step FLOPs and, for a GPU target, time and MFU (estimated by the cost model)."""
    m = cfg.model
    tokens = grad_accum * rows * cfg.train.seq_len
    n_params = param_count(m)
    matmul_params = n_params - m.vocab_size * m.d_model * (0 if m.tie_embeddings else 1)  # lookup is no matmul
    layer_ops = _op_flops(cfg, tokens)
    attention = 3.0 * layer_ops["attention"] * m.n_layers
    model_flops = 6.0 * matmul_params * tokens + attention
    recompute = recompute_flops_per_layer(cfg, tokens, bill.layout.saved,
                                          bill.layout.kernels.get("attention")) * m.n_layers
    hardware = model_flops + recompute
    if gpu is None:
        return Cost(n_params, model_flops, hardware, recompute, 0.0, 0.0, 0.0, 0.0, 0.0, tokens)
    peak = gpu.peak_flops(cfg.precision.compute_dtype)
    compute = hardware / (n_devices * peak * MATMUL_EFFICIENCY)
    # FSDP: all-gather weights for forward and backward, reduce-scatter gradients, every micro-batch.
    ways = bill.mesh["fsdp"] * bill.mesh["dp"] if cfg.parallel.zero_stage == 3 else 1
    weight_bytes = n_params * 2 / bill.mesh["tp"]
    collective = 3 * grad_accum * weight_bytes * (ways - 1) / ways / gpu.interconnect_bandwidth if ways > 1 else 0.0
    host_bytes = 2 * bill.host.get("activations", 0) * grad_accum + 2 * bill.host.get("params", 0) * grad_accum
    if cfg.offload.optimizer == "host":  # gradients down, updated weights back up, once per step
        host_bytes += bill.device["grads"] + n_params * 2 / n_devices
    host_link = host_bytes / gpu.host_link_bandwidth
    step = max(compute, collective, host_link)
    mfu = model_flops / (step * n_devices * peak) if step else 0.0
    return Cost(n_params, model_flops, hardware, recompute, compute, collective, host_link, step, mfu, tokens)
