"""The mixture-of-experts terms of the analytic bill and the cost model (jaxmem.model.moe): total vs active
parameters, the expert state per device, the routed rows' buffers, and the expert-parallel all-to-all bytes.

What the compiled step does today (deviceless h100-80g compiles, jax 0.10.2, read with `jaxmem explain`):
  * the dispatch sorts every token of the micro-batch by expert (one argsort over all of them), so each
    device holds all the routed rows, tokens x top-k of the whole micro-batch: [R, D] with R = N_global * k
    (tiny-moe on 8 devices: [2048, ...] buffers for 1024 tokens, top 2);
  * the layer scan's saved copies of those rows are split over the data axes along their feature dim
    ([L, R, D / 8], [L, R, F / 8]): per device the bytes of the device's own tokens;
  * `jax.lax.ragged_dot` is lowered for the GPU as one dense matmul per expert group over a masked copy of
    its operand: [E, R, D] and [E, R, F] buffers appear in each layer's backward (tiny-moe: an [8, 2048, 128]
    and two [2048, 8, 96]; Qwen3-30B-A3B widths, 2 layers, seq 1024: an [128, 65536, 2048] and its
    transposed copy, 32 GiB each). They dominate the step: expert parallelism (`parallel.ep`, rows split
    ep ways) or a grouped-matmul kernel is what removes them.
With expert parallelism (`parallel.ep` > 1, once it exists) tokens are dispatched to the devices holding
their experts by an all-to-all, so a device holds its own tokens' rows (R / data ways on average) and the
expert weights split ep x fsdp ways; the formulas below take ep from the config (1 today).
"""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.model.names import CheckpointName as CN
from jaxmem.model.presets import param_count

# the dense MLP's names a mixture of experts never tags (its experts tag the MoE names instead)
DENSE_MLP = (CN.MLP_GATE.value, CN.MLP_UP.value, CN.MLP_ACT.value)
# the routed rows' names, each [R, width] with width d_model or the expert width
_ROW_WIDE = (CN.MOE_DISPATCH.value, CN.EXPERT_OUT.value)
_EXPERT_WIDE = (CN.EXPERT_GATE.value, CN.EXPERT_UP.value, CN.EXPERT_ACT.value)


def is_moe(cfg: Config) -> bool:
    return cfg.model.n_experts > 0


def expert_width(cfg: Config) -> int:
    return cfg.model.expert_d_ff or cfg.model.d_ff


def expert_params(cfg: Config) -> int:
    """Elements of every layer's expert weights (gate, up, down of each expert)."""
    m = cfg.model
    return 3 * m.n_layers * m.n_experts * m.d_model * expert_width(cfg) if is_moe(cfg) else 0


def parameter_counts(cfg: Config) -> dict[str, int]:
    """Total parameters and the ones a token uses: the non-expert weights and k / E of the experts."""
    m = cfg.model
    total, experts = param_count(m), expert_params(cfg)
    active = total - experts + experts * m.experts_per_token // m.n_experts if is_moe(cfg) else total
    return {"total": total, "active": active, "experts": experts}


def expert_state_elems(cfg: Config, mesh_sizes: dict[str, int]) -> int:
    """Expert weight elements per device as the state holds them (ZeRO-3): split over fsdp today, over
    ep x fsdp once expert parallelism exists."""
    ep = max(cfg.parallel.ep, 1)
    return expert_params(cfg) // (ep * mesh_sizes["fsdp"])


def routed_rows(cfg: Config, layout) -> int:
    """Routed rows one device holds in a layer (tokens x top-k): the whole micro-batch's with ep = 1 (the
    dispatch sorts all tokens), its own tokens' with ep > 1 (an all-to-all brings each device the rows of
    its experts: the same count on average)."""
    tokens = layout.rows * cfg.train.seq_len
    rows = tokens * cfg.model.experts_per_token
    ep = max(cfg.parallel.ep, 1)
    return rows if ep == 1 else rows // (layout.data_ways * ep)


def name_shapes(cfg: Config, layout, cd: int) -> dict[str, int]:
    """Per-device elements (compute-dtype wide) of each MoE checkpoint name for one layer, as the layer
    scan saves it: split over the data axes (the saved rows' feature dim is); the fp32 router logits
    [tokens, experts] counted as compute-dtype elements of the same bytes."""
    m, ways = cfg.model, layout.data_ways
    rows = layout.rows * cfg.train.seq_len * m.experts_per_token
    out = {n: rows * m.d_model // ways for n in _ROW_WIDE}
    out.update({n: rows * expert_width(cfg) // ways for n in _EXPERT_WIDE})
    out[CN.ROUTER_LOGITS.value] = layout.rows * cfg.train.seq_len * m.n_experts * 4 // (cd * ways)
    out.update({n: 0 for n in DENSE_MLP})
    return out


def residual_bytes(cfg: Config, layout, cd: int) -> dict[str, int]:
    """Per-layer bytes autodiff keeps of the experts without any checkpoint (remat.preset=none): the
    dispatched rows, gate and up (the lean activation's residuals), the activation (the down projection's
    weight gradient reads it) and the router logits (`jaxmem explain` of tiny-moe, remat none: the stacked
    [L, R, D / 8] and three [L, R, F / 8] residuals)."""
    shapes = name_shapes(cfg, layout, cd)
    keep = (CN.MOE_DISPATCH, CN.EXPERT_GATE, CN.EXPERT_UP, CN.EXPERT_ACT, CN.ROUTER_LOGITS)
    return {n.value: shapes[n.value] * cd for n in keep}


# Above this size of one [E, R, F] copy XLA no longer keeps three whole expert-width copies at the peak:
# it splits them over the data axes (or drops them) and keeps the rows expanded twice. Fitted on seven
# deviceless h100-80g compiles: copies of 0.003-6 GiB (tiny-moe, Qwen3-30B-A3B widths at seq 256 and 512,
# Mixtral widths at seq 1024) kept three whole; 12, 28 and 96 GiB (Qwen3 at seq 1024 and 8192, Mixtral at
# seq 8192) did not.
WHOLE_COPY_LIMIT = 8 * 1024**3


def expanded_bytes(cfg: Config, layout, cd: int) -> int:
    """The masked per-expert copies of ragged_dot's dense lowering live at a MoE layer's backward peak (at
    the weight gradients). Small copies: the rows expanded, the gate and up gradients expanded, and one of
    them again in the transposed layout the input gradient reads, E x R x (D + 3F) (Mixtral widths, seq 1024:
    [8, R, 4096] + 3 x [8, R, 14336]; Qwen3-30B-A3B widths, seq 256: [128, R, 2048] + 3 x [128, R, 768]).
    Above WHOLE_COPY_LIMIT: the rows expanded twice and the expert-width copies split over the data axes,
    E x R x (2D + 2F / data ways) (Qwen3 at seq 1024: two [128, R, 2048]; Mixtral at seq 8192: two
    [8, R, 4096] and five [8, R, 14336 / 8], counted as two)."""
    m = cfg.model
    e, d, f = m.n_experts, m.d_model, expert_width(cfg)
    rows = routed_rows(cfg, layout)
    if e * rows * f * cd <= WHOLE_COPY_LIMIT:
        return e * rows * (d + 3 * f) * cd
    return e * rows * (2 * d + 2 * f // layout.data_ways) * cd


def working_bytes(cfg: Config, layout, cd: int) -> int:
    """Bytes of one MoE layer's backward at its peak beyond the attention's: expanded_bytes, and the rows
    with their gate and up gradients whole."""
    d, f = cfg.model.d_model, expert_width(cfg)
    return expanded_bytes(cfg, layout, cd) + routed_rows(cfg, layout) * (d + 2 * f) * cd


def all_to_all_bytes(cfg: Config, layout, itemsize: int) -> float:
    """Bytes one device sends per layer and micro-batch over the expert-parallel all-to-alls: dispatch and
    combine, forward and backward (2 x 2), each moving the (ep - 1) / ep of its rows bound for other
    devices. 0 with ep = 1."""
    ep = max(cfg.parallel.ep, 1)
    if ep == 1:
        return 0.0
    rows = layout.rows * cfg.train.seq_len * cfg.model.experts_per_token // (layout.data_ways * ep)
    return 2 * 2 * rows * cfg.model.d_model * itemsize * (ep - 1) / ep


def active_mlp_flops(cfg: Config, tokens: int) -> dict[str, float]:
    """Forward FLOPs of one MoE layer's MLP over `tokens` tokens: the router and the k experts each token
    runs (gate + up as "up_proj" per matmul, down), not all E."""
    m = cfg.model
    d, f, k = m.d_model, expert_width(cfg), m.experts_per_token
    return {"router": 2.0 * tokens * d * m.n_experts, "up_proj": 2.0 * tokens * k * d * f,
            "down_proj": 2.0 * tokens * k * f * d}


def note(cfg: Config, layout) -> str:
    counts = parameter_counts(cfg)
    m = cfg.model
    return (f"mixture of experts ({m.n_experts} experts, top {m.experts_per_token}): "
            f"{counts['total'] / 1e9:.2f}B parameters, {counts['active'] / 1e9:.2f}B active per token; "
            f"{routed_rows(cfg, layout):,} routed rows per device and layer; ragged_dot's dense GPU lowering "
            f"expands them per expert ({m.n_experts} x rows x width) in the backward; the step time counts the "
            f"k active experts' FLOPs, not the expanded matmuls (estimated)")
