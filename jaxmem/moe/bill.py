"""The mixture-of-experts terms of the analytic bill (jaxmem.plan.bill: BILL_TERMS) and the formulas the cost
model reads (jaxmem.model.moe): total vs active parameters, the expert state per device, the routed rows'
buffers, and the expert-parallel all-to-all bytes.

What the compiled step holds (deviceless h100-80g compiles, jax 0.10.2, read with `jaxmem explain`;
benchmarks/moe.md has the checks):
  * ep = 1: the dispatch sorts every token of the micro-batch by expert, so each device holds all the routed
    rows, tokens x top-k of the whole micro-batch: R = N_global x k; the layer scan's saved copies of them
    are split over the data axes along their feature dim;
  * ep > 1: each device receives ep x C rows over an all-to-all (C from the capacity rule of
    jaxmem.moe.expert_parallel) and runs its E / ep experts on them, inside a shard_map (nothing split);
  * with sequence tiles (`remat.seq_tile`) each tile routes its own tokens: the buffers of the kernel and the
    dispatch hold one tile's rows (`per_tile`), the saved names are recomputed tile by tile;
  * the experts' grouped matmul (`kernels.grouped_matmul`, resolved as jaxmem.kernels.resolve does) decides
    the rest: blocked pads the rows per expert to whole blocks and accumulates d_w in fp32; pallas pads them
    too; ragged_dot is lowered for the GPU as one dense matmul per expert over a masked [E, R, width] copy
    (kernel_scratch_bytes; its live set is fitted, see WHOLE_COPY_LIMIT).
"""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.moe.expert_parallel import capacity
from jaxmem.model.seq_tiling import tile_count
from jaxmem.kernels.grouped_matmul.blocked import MAX_CHUNK_BLOCKS
from jaxmem.kernels.grouped_matmul.config import GroupedMatmulBlocks
from jaxmem.kernels.grouped_matmul.layout import padded_blocks
from jaxmem.config.names import CheckpointName as CN
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


def grouped_matmul_kernel(layout) -> str:
    """The experts' grouped matmul the step runs (jaxmem.kernels.resolve: blocked, pallas or ragged_dot)."""
    return layout.kernels.get("grouped_matmul", "blocked")


def seq_tiles(cfg: Config, layout) -> int:
    """Sequence tiles a layer's MoE MLP runs in (remat.seq_tile; 1 without): each routes its own tokens."""
    return tile_count(cfg.train.seq_len, layout.mesh_sizes.get("sp", 1), cfg.remat.seq_tile)


def tokens_per_device(cfg: Config, layout, per_tile: bool = False) -> int:
    """Tokens one device routes per micro-batch (`per_tile`: per sequence tile): its batch rows (split over
    dp x fsdp x ep) x its sequence."""
    tokens = layout.rows * cfg.train.seq_len // (layout.data_ways * layout.mesh_sizes.get("sp", 1))
    return tokens // seq_tiles(cfg, layout) if per_tile else tokens


def peer_capacity(cfg: Config, layout, per_tile: bool = False) -> int:
    """C, the rows a device sends each ep peer (jaxmem.moe.expert_parallel.capacity): dropless
    tokens x min(k, E / ep), or ceil(c x tokens x k / ep) with model.moe_capacity_factor c."""
    m = cfg.model
    return capacity(tokens_per_device(cfg, layout, per_tile), m.experts_per_token, m.n_experts,
                    max(cfg.parallel.ep, 1), m.moe_capacity_factor)


def routed_rows(cfg: Config, layout, per_tile: bool = False) -> int:
    """Routed rows one device runs through its experts in a layer (`per_tile`: in one sequence tile, what the
    kernel's and the dispatch's buffers hold): with ep = 1 the whole micro-batch's tokens x top-k (the
    dispatch sorts all tokens); with ep > 1 the receive buffer's ep x C rows (padding included: the grouped
    matmul sees them all)."""
    ep = max(cfg.parallel.ep, 1)
    if ep == 1:
        rows = layout.rows * cfg.train.seq_len * cfg.model.experts_per_token
        return rows // seq_tiles(cfg, layout) if per_tile else rows
    return ep * peer_capacity(cfg, layout, per_tile)


def local_experts(cfg: Config) -> int:
    return cfg.model.n_experts // max(cfg.parallel.ep, 1)


def name_shapes(cfg: Config, layout, cd: int) -> dict[str, int]:
    """Per-device elements (compute-dtype wide) of each MoE checkpoint name for one layer, as the layer
    scan saves it. ep = 1: split over the data axes (the saved rows' feature dim is); ep > 1: the device's
    own ep x C rows, whole. The fp32 router logits [tokens, experts] counted as compute-dtype elements of the
    same bytes."""
    m = cfg.model
    rows = routed_rows(cfg, layout)
    ways = layout.data_ways if cfg.parallel.ep <= 1 else 1
    out = {n: rows * m.d_model // ways for n in _ROW_WIDE}
    out.update({n: rows * expert_width(cfg) // ways for n in _EXPERT_WIDE})
    out[CN.ROUTER_LOGITS.value] = tokens_per_device(cfg, layout) * m.n_experts * 4 // cd
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


def working_names(cfg: Config, per_name: dict[str, int]) -> dict[str, int]:
    """per_name as the layer's working set counts it: with ep > 1 the routed rows' values are the
    device's whole ep x C rows, already in working_bytes (the kernel's buffers and the all-to-all ones), so
    the MoE names count 0 there (Mixtral widths, ep 8, seq 32768: counting both over-estimated by a third)."""
    if not is_moe(cfg) or cfg.parallel.ep <= 1:
        return per_name
    return {n: 0 if n in _ROW_WIDE + _EXPERT_WIDE else v for n, v in per_name.items()}


# kernels.grouped_matmul=ragged_dot only. Above this size of one [G, R, F] copy XLA no longer keeps three
# whole expert-width copies at the peak: it splits them over the data axes (or drops them) and keeps the rows
# expanded twice. A FITTED constant, not derived: from seven deviceless h100-80g compiles (ragged_dot, ep = 1),
# small copies kept three whole, large ones did not (the compiles: benchmarks/constants.md, moe).
WHOLE_COPY_LIMIT = 8 * 1024**3


def ragged_dot_copy_bytes(cfg: Config, layout, cd: int) -> int:
    """kernels.grouped_matmul=ragged_dot: XLA:GPU lowers it densely, one masked [G, rows, width] copy of an
    operand per matmul (G the device's experts); at a layer's weight-gradient backward the rows expanded,
    the gate and up gradients expanded, and one of them again transposed for the input gradient:
    G x R x (D + 3F) (Mixtral widths, seq 1024: [8, R, 4096] + 3 x [8, R, 14336]; Qwen3-30B-A3B widths,
    seq 256: [128, R, 2048] + 3 x [128, R, 768]). Above WHOLE_COPY_LIMIT: the rows expanded twice and the
    expert-width copies split over the data axes, G x R x (2D + 2F / data ways)."""
    m = cfg.model
    g, d, f = local_experts(cfg), m.d_model, expert_width(cfg)
    rows = routed_rows(cfg, layout, per_tile=True)
    if g == 1:  # one expert a device (Mixtral widths, ep 8): a plain matmul, no masked copies; three [R, F]
        return rows * f * cd  # values at the peak, one more than the rows' gate and up gradients (working_bytes)
    if cfg.parallel.ep > 1:
        # inside the expert-parallel shard_map nothing is split: the rows expanded twice and four expert-width
        # copies (Qwen3-30B-A3B widths, ep 8, 16 experts a device, seq 1024 dropless and capacity 1.25: two
        # [16, R, 2048], three [16, R, 768] and one [R, 16, 768]); above WHOLE_COPY_LIMIT the rows expanded three
        # times and no expert-width copy (seq 8192 dropless: three [R, 16, 2048]). Observed, not derived.
        if g * rows * f * cd <= WHOLE_COPY_LIMIT:
            return g * rows * (2 * d + 4 * f) * cd
        return g * rows * 3 * d * cd
    if g * rows * f * cd <= WHOLE_COPY_LIMIT:
        return g * rows * (d + 3 * f) * cd
    return g * rows * (2 * d + 2 * f // layout.data_ways) * cd


def blocked_plan(cfg: Config, layout, d_in: int, d_out: int, cd: int) -> tuple[int, int, int]:
    """(block rows, blocks per chunk, padded rows P) of the blocked / pallas kernels for one
    [rows, d_in] x [G, d_in, d_out] matmul, as jaxmem.kernels.grouped_matmul plans them: each expert's rows
    padded to whole blocks (layout.padded_blocks), blocked also to whole chunks of blocks (about
    CHUNK_WEIGHT_BYTES of gathered weights per chunk, at most MAX_CHUNK_BLOCKS)."""
    rows, groups = routed_rows(cfg, layout, per_tile=True), local_experts(cfg)
    block = max(1, min(cfg.kernels.grouped_matmul_block_rows, rows))
    n_blocks = padded_blocks(rows, groups, block)
    if grouped_matmul_kernel(layout) != "blocked":
        return block, 1, n_blocks * block
    chunk = min(GroupedMatmulBlocks(block_rows=block).chunk(n_blocks, d_in * d_out * cd), MAX_CHUNK_BLOCKS)
    return block, chunk, -(-n_blocks // chunk) * chunk * block


def width_split(cfg: Config, layout) -> int:
    """Ways the blocked kernel's expert-width values are split: at ep = 1 GSPMD partitions its plain-XLA loop
    over the data axes like the fsdp-split expert weights it reads (`jaxmem explain`, Mixtral widths, 2 layers,
    8 x h100-80g: padded rows [P, 4096] whole, expert-width ones [P, 14336 / 8], the fp32 d_w
    [8, 4096 / 8, 14336]); inside the expert-parallel shard_map, and for the Pallas kernel (a custom call GSPMD
    runs whole on every device), 1."""
    if grouped_matmul_kernel(layout) != "blocked" or cfg.parallel.ep > 1:
        return 1
    return layout.data_ways


def ungathered_expert_elems(cfg: Config, layout) -> int:
    """Expert weight elements of one layer that the step never gathers, to take out of the gathered layer's
    count: blocked at ep = 1 (width_split > 1: each device reads only its fsdp share), and with ep > 1 and no
    other data axis the local experts (the state's own slice, used in place: Mixtral widths, 2 layers, ep 8,
    `jaxmem explain` holds no gathered expert weights)."""
    if not is_moe(cfg):
        return 0
    per_layer = expert_params(cfg) // cfg.model.n_layers // layout.mesh_sizes.get("tp", 1)
    ep = max(cfg.parallel.ep, 1)
    if ep > 1:  # the layer counts its E / ep local experts whole; nothing gathers them without fsdp / dp ways
        return per_layer // ep if layout.data_ways == ep else 0
    ways = width_split(cfg, layout)
    return per_layer - per_layer // ways


# Expert-width padded buffers the blocked backward holds at its peak (explain, Mixtral widths seq 8192: six
# [P, F / 8]: the padded gate / up / output-gradient rows and their transposes), with the rows padded whole.
_BLOCKED_WIDE = 6


def kernel_scratch_bytes(cfg: Config, layout, cd: int) -> int:
    """The experts' grouped-matmul scratch at a MoE layer's backward peak. ragged_dot: its dense per-expert
    copies (ragged_dot_copy_bytes). blocked: the padded rows [P, D] and six expert-width padded buffers
    [P, F / width_split], the fp32 [G, D, F] d_w accumulator split alike, and one loop step's chunk (its
    gathered weights, fp32 d_x and d_w products: tiny-moe's largest buffer is the [16, 128, 128] fp32 d_x
    chunk), or the recomputed forward's rows and padded output, whichever is larger; pallas: the padded rows, output
    gradient and input gradient whole, P x (2D + F), its d_w written once in the weights' dtype."""
    kernel = grouped_matmul_kernel(layout)
    if kernel == "ragged_dot":
        return ragged_dot_copy_bytes(cfg, layout, cd)
    d, f = cfg.model.d_model, expert_width(cfg)
    block, chunk, rows = blocked_plan(cfg, layout, d, f, cd)
    if kernel == "pallas":
        return rows * (2 * d + f) * cd + local_experts(cfg) * d * f * cd
    ways = width_split(cfg, layout)
    loop_step = chunk * (block * d * 4 + d * f * (4 + cd) // ways)  # fp32 d_x and d_w products, the weights
    backward = rows * (d + _BLOCKED_WIDE * f // ways) * cd + local_experts(cfg) * d * f * 4 // ways + loop_step
    if cfg.parallel.ep > 1:  # inside the shard_map: two more padded [P, D] and the received rows [R, D] twice
        backward += (2 * rows + 2 * routed_rows(cfg, layout, per_tile=True)) * d * cd  # (explain, Qwen3 widths, ep 8)
    # the recomputed forward's down projection: the sorted rows [R, D] and its padded output [P, D] (Qwen3-30B-A3B
    # widths at seq 65536, where D is 21 x F / 8: a [4194304, 2048] and a [4211200, 1, 2048] at the peak)
    forward = (routed_rows(cfg, layout, per_tile=True) + rows) * d * cd
    return max(backward, forward)


def working_bytes(cfg: Config, layout, cd: int) -> int:
    """Bytes of one MoE layer's backward at its peak beyond the attention's: the kernel's scratch; with
    ragged_dot also the rows with their gate and up gradients whole; with ep > 1 the all-to-all send and
    receive buffers ([ep, C, D] each) of the recomputed forward."""
    d, f = cfg.model.d_model, expert_width(cfg)
    out = kernel_scratch_bytes(cfg, layout, cd)
    rows = routed_rows(cfg, layout, per_tile=True)
    if grouped_matmul_kernel(layout) == "ragged_dot":
        out += rows * (d + 2 * f) * cd
    if cfg.parallel.ep > 1:
        out += 2 * rows * d * cd
    return out


def all_to_all_bytes(cfg: Config, layout, itemsize: int) -> float:
    """Bytes one device sends per layer and micro-batch over the expert-parallel all-to-alls: dispatch and
    combine, forward and backward (2 x 2), each moving the padded [ep, C, D] buffer, (ep - 1) / ep of it to
    other devices (padding travels too). 0 with ep = 1."""
    ep = max(cfg.parallel.ep, 1)
    if ep == 1:
        return 0.0
    return 2 * 2 * routed_rows(cfg, layout) * cfg.model.d_model * itemsize * (ep - 1) / ep


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
    kernel = grouped_matmul_kernel(layout)
    held = {"ragged_dot": "ragged_dot's dense GPU lowering expands them per expert (experts x rows x width)",
            "blocked": "the blocked grouped matmul pads them to whole blocks and accumulates d_w in fp32",
            "pallas": "the Pallas grouped matmul pads them to whole blocks"}[kernel]
    ep = max(cfg.parallel.ep, 1)
    where = (f"ep {ep}: {local_experts(cfg)} experts per device, {peer_capacity(cfg, layout):,} rows per peer "
             f"in the all-to-all buffers" if ep > 1 else "all of the micro-batch's tokens x top-k")
    tiles = seq_tiles(cfg, layout)
    tiled = f", {routed_rows(cfg, layout, per_tile=True):,} per sequence tile ({tiles} tiles)" if tiles > 1 else ""
    return (f"mixture of experts ({m.n_experts} experts, top {m.experts_per_token}): "
            f"{counts['total'] / 1e9:.2f}B parameters, {counts['active'] / 1e9:.2f}B active per token; "
            f"{routed_rows(cfg, layout):,} routed rows per device and layer ({where}){tiled}; {held} in the backward; "
            f"the step time counts the k active experts' FLOPs (estimated)")


def _shapes(d) -> None:
    """The experts' routed rows instead of the dense MLP's [tokens, d_ff] values."""
    d.per_name.update(name_shapes(d.cfg, d.layout, d.cd))
    d.working_names = working_names(d.cfg, d.per_name)


def _state(d) -> None:
    """A mixture of experts gathers each layer whole and its gradient arrives whole before the reduce-scatter,
    both double-buffered (Mixtral and Qwen3-30B-A3B widths, `jaxmem explain`); the experts some layouts never
    gather are left out."""
    d.layer_elems_not_gathered = ungathered_expert_elems(d.cfg, d.layout)
    d.gathers_layer_whole = True


def _activations(d) -> None:
    cfg, layout = d.cfg, d.layout
    d.notes.append(note(cfg, layout))
    if layout.checkpointed:
        return
    d.saved_dev = {k: v for k, v in d.saved_dev.items() if k not in DENSE_MLP}
    if seq_tiles(cfg, layout) == 1:  # in sequence tiles they are recomputed, tile by tile
        d.saved_dev.update({k: v * cfg.model.n_layers for k, v in residual_bytes(cfg, layout, d.cd).items()})


def _working(d) -> None:
    scratch = kernel_scratch_bytes(d.cfg, d.layout, d.cd)
    if scratch:  # the bill's layer phase counts it in the experts' own phase (Bill.feature_scratch)
        d.feature_scratch["moe"] = scratch
        d.device["working_set"] += working_bytes(d.cfg, d.layout, d.cd)


BILL_TERMS = (("shapes", _shapes), ("state", _state), ("activations", _activations), ("working", _working))
