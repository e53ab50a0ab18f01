"""The mixture of experts' terms of the step-time cost model (jaxmem.plan.costmodel asks the active features
for them, jaxmem.core.plugins.Feature): the k active experts' FLOPs instead of the dense MLP's, the grouped
matmul's own achieved rate, the expert-parallel all-to-alls, and the experts' ZeRO-3 gathers. Every figure is
an estimate.
"""
from __future__ import annotations

import math

from jaxmem.config.schema import Config
from jaxmem.mesh.sharding import batch_ways
from jaxmem.moe import bill as bill_moe

# The experts' grouped matmul per kernel, on the active FLOPs (6 x rows x D x F: forward and both gradients), by
# (rows per expert, D, F), timed on a GPU with rows routed uniformly at random (scripts/bench_grouped_matmul.py;
# benchmarks/gpu_h200.md; benchmarks/constants.md, costmodel). Its rate grows with the rows per expert (each
# expert's rows pad to whole 128-row blocks; d_w loops over an expert's blocks) and the widths. Other shapes:
# the nearest measured one (log2 distance). ragged_dot, densified by XLA:GPU, was timed at one shape only.
GROUPED_MATMUL_EFFICIENCY_BY_SHAPE = {
    "pallas": {(64, 2048, 768): 0.057, (128, 2048, 768): 0.100, (512, 2048, 768): 0.183,
               (512, 4096, 1536): 0.258, (512, 4096, 14336): 0.370, (2048, 4096, 14336): 0.425},
    "blocked": {(64, 2048, 768): 0.018, (128, 2048, 768): 0.027, (512, 2048, 768): 0.047,
                (512, 4096, 1536): 0.050, (512, 4096, 14336): 0.060, (2048, 4096, 14336): 0.072},
    "ragged_dot": {(128, 2048, 768): 0.0066},
}
# What the cost model's output reports of the experts on every run (0 for a dense model) and the constants it
# lists.
BREAKDOWN_DEFAULTS = {"expert_matmul_flops": 0.0}
CONSTANTS = {"grouped_matmul_efficiency_by_shape": {
    kernel: {"x".join(map(str, key)): e for key, e in table.items()}
    for kernel, table in GROUPED_MATMUL_EFFICIENCY_BY_SHAPE.items()}}
_EXPERT_OPS = ("up_proj", "down_proj")


def grouped_matmul_efficiency(kernel: str, rows_per_expert: float, d: int, f: int) -> float:
    """Achieved fraction of the dense peak of the experts' grouped matmul: the nearest measured shape's."""
    table = GROUPED_MATMUL_EFFICIENCY_BY_SHAPE[kernel]
    near = min(table, key=lambda key: sum(abs(math.log2(max(a, 1) / b)) for a, b in zip((rows_per_expert, d, f),
                                                                                       key)))
    return table[near]


def layer_flops(cfg: Config, tokens: int, ops: dict[str, float]) -> dict[str, float]:
    """A layer's forward FLOPs with the router and the k experts a token runs, not all of them."""
    moe = bill_moe.active_mlp_flops(cfg, tokens)
    return dict(ops, up_proj=moe["up_proj"], down_proj=moe["down_proj"], router_proj=moe["router"])


def mlp_width_per_token(cfg: Config, width: int) -> int:
    """The MLP activations' width per token: a token's k experts'."""
    return cfg.model.experts_per_token * bill_moe.expert_width(cfg)


def expert_efficiency(cfg: Config, bill, kernel: str) -> float:
    """The grouped matmul's rate at this step's shape: a device's routed rows per local expert (its tokens x
    top-k without ep; the all-to-all buffer's rows with ep) and the expert widths."""
    layout = bill.layout
    rows = (bill_moe.routed_rows(cfg, layout) if cfg.parallel.ep > 1
            else bill_moe.tokens_per_device(cfg, layout) * cfg.model.experts_per_token)
    return grouped_matmul_efficiency(kernel, rows / bill_moe.local_experts(cfg), cfg.model.d_model,
                                     bill_moe.expert_width(cfg))


def own_rate_matmuls(cfg: Config, bill, ops: dict, rebuilt: list[str], weight_passes: int):
    """(FLOPs, achieved fraction of peak, breakdown entries) of the experts' MLP matmuls, run as grouped
    matmuls at their kernel's rate: forward, backward and the remat recompute."""
    flops = (weight_passes * (2 * ops["up_proj"] + ops["down_proj"])
             + sum(ops[o] for o in rebuilt if o in _EXPERT_OPS)) * cfg.model.n_layers
    kernel = bill.layout.kernels.get("grouped_matmul", "blocked")
    rate = expert_efficiency(cfg, bill, kernel) if flops else 1.0
    return flops, rate, {"expert_matmul_flops": flops, **({"grouped_matmul_kernel": kernel} if flops else {})}


def expert_parallel_seconds(cfg: Config, bill, gpu, grad_accum: int) -> float:
    """The expert-parallel all-to-alls per step (dispatch and combine, forward and backward, every layer and
    micro-batch; jaxmem.moe.bill.all_to_all_bytes), at the interconnect bandwidth (estimated). 0 without
    expert parallelism."""
    cd = 2 if cfg.precision.compute_dtype != "float32" else 4
    moved = grad_accum * cfg.model.n_layers * bill_moe.all_to_all_bytes(cfg, bill.layout, cd)
    return moved / gpu.interconnect_bandwidth


def zero3_gathered(cfg: Config, bill) -> tuple[int, float]:
    """(the expert weights' elements, the bf16 bytes of them one ZeRO-3 all-gather brings each device per pass):
    split over ep, never gathered over it, so gathered over dp x fsdp only (an ep-th of them per device)."""
    ep = max(cfg.parallel.ep, 1)
    expert_ways = batch_ways(bill.mesh) // ep
    experts = bill_moe.expert_params(cfg)
    return experts, experts / ep * 2 / bill.mesh["tp"] * ((expert_ways - 1) / expert_ways)
