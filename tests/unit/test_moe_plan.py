"""The planner knows a mixture of experts (jaxmem/moe/bill.py): total vs active parameters, the expert state
per device, the routed rows' buffers in the bill, active-expert FLOPs and the expert-parallel all-to-alls in
the cost model. Analytic only (no compile): tests/integration/test_moe_plan_compiled.py checks the bill against
deviceless compiles."""
import dataclasses

import pytest

from jaxmem.loader import load_config
from jaxmem.config.targets import get_target
from jaxmem.core.layout import spec_leaves
from jaxmem.model.presets import active_param_count
from jaxmem.plan import costmodel
from jaxmem.moe import bill as bill_moe, cost as moe_cost
from jaxmem.plan.bill import compute_bill

QWEN = ["model.preset=qwen3-30b-a3b", "parallel.fsdp=8", "parallel.rules=fsdp", "parallel.zero_stage=3",
        "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true",
        "kernels.attention=pallas", "kernels.loss=chunked", "train.micro_batch=1"]


def _qwen(*extra, layers=2, seq=1024):
    return load_config("configs/tiny.yaml", QWEN + [f"model.n_layers={layers}", f"train.seq_len={seq}", *extra])


def test_total_and_active_parameters_of_the_presets():
    for preset, total, active in (("qwen3-30b-a3b", 30.53e9, 3.35e9), ("mixtral-8x7b", 46.70e9, 12.88e9)):
        counts = bill_moe.parameter_counts(load_config("configs/tiny.yaml", [f"model.preset={preset}"]))
        assert counts["total"] == pytest.approx(total, rel=5e-3)
        assert counts["active"] == pytest.approx(active, rel=5e-3)
        assert counts["active"] == active_param_count(load_config("configs/tiny.yaml", [f"model.preset={preset}"]).model)
    m = load_config("configs/tiny-moe.yaml").model  # 8 experts, top 2: 6 of 8 experts idle per token
    counts = bill_moe.parameter_counts(load_config("configs/tiny-moe.yaml"))
    assert counts["total"] - counts["active"] == m.n_layers * 6 * 3 * m.d_model * m.expert_d_ff
    dense = bill_moe.parameter_counts(load_config("configs/tiny.yaml"))
    assert dense["total"] == dense["active"] and dense["experts"] == 0


def test_plan_reports_total_and_active_parameters():
    from jaxmem.plan import plan, resolve_topology

    cfg = load_config("configs/tiny-moe.yaml", ["target.name=h100-80g", "target.gpus_per_host=8"])
    p = plan(cfg, resolve_topology(cfg), compile=False)
    counts = bill_moe.parameter_counts(cfg)
    assert (p["params"], p["active_params"]) == (counts["total"], counts["active"])
    assert p["active_params"] < p["params"]
    assert any(n.startswith("mixture of experts") and "active per token" in n for n in p["analytic"]["notes"])


def test_expert_state_per_device_is_split_over_fsdp_as_the_formula_says():
    cfg = _qwen()
    layout = compute_bill(cfg, 8).layout
    layers, specs = layout.abstract_params["layers"], layout.param_specs["layers"]
    expert_elems = 0
    for name in ("expert_gate", "expert_up", "expert_down"):
        (spec,) = spec_leaves(specs[name])
        shape = layers[name].shape
        ways = 1
        for axes in spec:
            for a in (axes if isinstance(axes, tuple) else (axes,)):
                ways *= layout.mesh_sizes[a] if a else 1
        expert_elems += shape[0] * shape[1] * shape[2] * shape[3] // ways
    assert expert_elems == bill_moe.expert_state_elems(cfg, layout.mesh_sizes)
    # once ep exists the experts split ep x fsdp ways (the formula reads parallel.ep)
    ep4 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=4, fsdp=2))
    assert bill_moe.expert_state_elems(ep4, {"fsdp": 2}) == bill_moe.expert_params(cfg) // 8


def test_ragged_dot_bill_has_its_dense_per_expert_copies():
    cfg = _qwen("kernels.grouped_matmul=ragged_dot")
    bill = compute_bill(cfg, 8)
    e, d, f, k = 128, 2048, 768, 8
    rows = 8 * 1024 * k  # the whole micro-batch's tokens (8 rows of 1024) x top-8 on every device
    assert bill_moe.routed_rows(cfg, bill.layout) == rows
    # one [E, R, F] copy is 12 GiB: above the (fitted) whole-copy limit, the rows expanded twice and the
    # expert-width copies split over the 8 data ways
    assert e * rows * f * 2 > bill_moe.WHOLE_COPY_LIMIT
    expanded = e * rows * (2 * d + 2 * f // 8) * 2
    assert bill.feature_scratch.get("moe", 0) == expanded
    small = compute_bill(_qwen("kernels.grouped_matmul=ragged_dot", seq=256), 8)  # 3 GiB copies: kept whole
    assert small.feature_scratch.get("moe", 0) == e * (rows // 4) * (d + 3 * f) * 2
    assert bill.device["working_set"] >= expanded + rows * (d + 2 * f) * 2
    assert bill.layer_phase >= bill.device["working_set"] - bill.attention_scratch
    assert bill.device_total > expanded


def test_blocked_bill_has_padded_rows_and_an_fp32_accumulator_not_dense_copies():
    cfg = _qwen()  # kernels.grouped_matmul=auto: blocked
    bill = compute_bill(cfg, 8)
    assert bill_moe.grouped_matmul_kernel(bill.layout) == "blocked"
    e, d, f, rows = 128, 2048, 768, 8 * 1024 * 8
    # by hand: 65536 rows in blocks of 128 over 128 experts need at most 512 + 127 blocks; a chunk gathers
    # 32 MiB / (2048 x 768 x 2 bytes) = 10 experts' weights, so 64 chunks of 10 blocks: 81920 padded rows
    padded = 64 * 10 * 128
    assert bill_moe.blocked_plan(cfg, bill.layout, d, f, 2) == (128, 10, padded)
    loop_step = 10 * (128 * d * 4 + d * f * 6 // 8)
    backward = padded * (d + 6 * f // 8) * 2 + e * d * f * 4 // 8 + loop_step
    forward = (rows + padded) * d * 2  # the recomputed down projection: sorted rows and padded output
    assert forward > backward  # Qwen3's expert width is narrow: 768 / 8 per device
    assert bill.feature_scratch.get("moe", 0) == forward
    assert bill_moe.kernel_scratch_bytes(_qwen("model.expert_d_ff=8192"), bill.layout, 2) > (rows + padded) * d * 2
    ragged = compute_bill(_qwen("kernels.grouped_matmul=ragged_dot"), 8)
    assert bill.feature_scratch.get("moe", 0) < ragged.feature_scratch.get("moe", 0) / 50  # 0.5 GiB against 67 GiB
    # GSPMD splits the blocked loop like the fsdp-split experts: the layer's experts are never gathered whole
    # (the gathered bf16 layer and its full bf16 gradient, both double-buffered: 8 bytes per expert weight)
    assert ragged.device["temporaries"] - bill.device["temporaries"] == 8 * (3 * e * d * f) * 7 // 8
    pallas = compute_bill(_qwen("kernels.grouped_matmul=pallas"), 8)  # runs whole on every device
    assert pallas.feature_scratch.get("moe", 0) == (512 + 127) * 128 * (2 * d + f) * 2 + e * d * f * 2


def test_expert_parallel_rows_follow_the_capacity_rule():
    ep8 = _qwen("parallel.fsdp=1", "parallel.ep=8")
    layout = compute_bill(ep8, 8).layout
    tokens = 8 * 1024 // 8  # each device routes its own row of 1024 tokens
    assert bill_moe.tokens_per_device(ep8, layout) == tokens
    # dropless: C = tokens x min(k, E / ep) = 1024 x 8 per peer, ep x C rows received
    assert bill_moe.routed_rows(ep8, layout) == 8 * tokens * 8
    capped = _qwen("parallel.fsdp=1", "parallel.ep=8", "model.moe_capacity_factor=1.25")
    assert bill_moe.routed_rows(capped, layout) == 8 * 1280  # ceil(1.25 x 1024 x 8 / 8) per peer
    # the local experts: 16 per device, their padded layout over the received rows
    assert bill_moe.local_experts(ep8) == 16
    # 10240 rows over 16 experts: at most 80 + 15 blocks, in chunks of 10: 100 blocks
    assert bill_moe.blocked_plan(capped, layout, 2048, 768, 2)[2] == 100 * 128
    assert bill_moe.width_split(ep8, layout) == 1  # inside the shard_map GSPMD does not split it


def test_saved_residuals_are_the_experts_not_a_dense_mlp():
    cfg = _qwen("remat.preset=none", seq=256)
    bill = compute_bill(cfg, 8)
    saved = bill.activations_by_name
    rows = 8 * 256 * 8
    assert saved["moe_dispatch"] == 2 * rows * 2048 // 8 * 2  # two layers, split over the 8 data ways, bf16
    for name in ("expert_gate", "expert_up", "expert_act"):
        assert saved[name] == 2 * rows * 768 // 8 * 2
    assert saved["router_logits"] == 2 * 8 * 256 * 128 * 4 // 8  # fp32
    assert not {"mlp_gate", "mlp_up", "mlp_act"} & set(saved)
    # a policy that saves an expert value keeps it at its routed size
    kept = compute_bill(_qwen("remat.preset=full", "remat.names.expert_act=device", seq=256), 8)
    assert kept.activations_by_name["expert_act"] == saved["expert_act"]


def test_cost_model_counts_the_active_experts_only():
    cfg = _qwen("remat.preset=none", seq=1024)  # no recompute: each matmul runs forward + 2 x backward
    tokens = 8 * 1024
    ops = costmodel._op_flops(cfg, tokens)
    assert ops["up_proj"] == pytest.approx(2.0 * tokens * 8 * 2048 * 768)  # k = 8 of 128 experts
    assert ops["down_proj"] == pytest.approx(2.0 * tokens * 8 * 768 * 2048)
    assert ops["router_proj"] == pytest.approx(2.0 * tokens * 2048 * 128)
    bill = compute_bill(cfg, 8)
    parts = costmodel.time_breakdown(cfg, bill, get_target("h100-80g"), 8, 1, 8)
    m = cfg.model
    attn = 2 * tokens * 2048 * (m.n_heads * m.head_dim * 2 + m.n_kv_heads * m.head_dim * 2)
    layer = attn + 3 * ops["up_proj"] + ops["router_proj"]  # q, k, v, o; gate, up, down; router
    assert parts["matmul_flops"] == pytest.approx(3 * layer * m.n_layers)
    # model FLOPs: 6 x active matmul params x tokens (+ attention): far below all 128 experts'
    cost = costmodel.estimate(cfg, bill, get_target("h100-80g"), 8, 1, 8)
    counts = bill_moe.parameter_counts(cfg)
    assert cost.model_flops < 6.0 * (counts["total"] - counts["experts"] / 2) * tokens


def test_all_to_all_bytes_follow_ep():
    cfg = _qwen(seq=1024)
    bill = compute_bill(cfg, 8)
    assert bill_moe.all_to_all_bytes(cfg, bill.layout, 2) == 0.0
    assert moe_cost.expert_parallel_seconds(cfg, bill, get_target("h100-80g"), 1) == 0.0
    ep8 = _qwen("parallel.fsdp=1", "parallel.ep=8")
    ep_bill = compute_bill(ep8, 8)
    received = 8 * 1024 * 8  # ep x C, dropless
    # dispatch and combine, forward and backward, the whole padded buffer, 7/8 of it off the device
    assert bill_moe.all_to_all_bytes(ep8, ep_bill.layout, 2) == pytest.approx(2 * 2 * received * 2048 * 2 * 7 / 8)
    seconds = moe_cost.expert_parallel_seconds(ep8, ep_bill, get_target("h100-80g"), 1)
    assert seconds == pytest.approx(2 * bill_moe.all_to_all_bytes(ep8, ep_bill.layout, 2)
                                    / get_target("h100-80g").interconnect_bandwidth)
    # the step's bill holds the send and receive buffers ([ep, C, D] each) on top of the kernel's scratch
    assert ep_bill.device["working_set"] >= bill_moe.kernel_scratch_bytes(ep8, ep_bill.layout, 2) + 2 * received * 2048 * 2


def test_zero3_collectives_count_ep_among_the_state_axes():
    n_params = bill_moe.parameter_counts(_qwen())["total"]
    experts = bill_moe.expert_params(_qwen())
    fsdp8, ep8 = _qwen(), _qwen("parallel.fsdp=1", "parallel.ep=8")
    dense_part = (n_params - experts) * 2 * 7 / 8
    # fsdp 8: every weight gathered over 8; ep 8: the non-expert weights over the 8 ep devices, experts never
    assert costmodel.zero3_gathered_bytes(fsdp8, compute_bill(fsdp8, 8), n_params) == pytest.approx(
        dense_part + experts * 2 * 7 / 8)
    assert costmodel.zero3_gathered_bytes(ep8, compute_bill(ep8, 8), n_params) == pytest.approx(dense_part)
    mixed = _qwen("parallel.fsdp=2", "parallel.ep=4")
    assert costmodel.zero3_gathered_bytes(mixed, compute_bill(mixed, 8), n_params) == pytest.approx(
        dense_part + experts / 4 * 2 / 2)


def test_the_tuner_counts_ep_among_the_batch_ways():
    from jaxmem.cli.tune import _data_ways

    assert _data_ways(_qwen("parallel.fsdp=2", "parallel.ep=4"), 8) == 8
    assert _data_ways(_qwen("parallel.fsdp=1", "parallel.ep=8"), 8) == 8


def test_a_dense_model_gets_no_moe_terms():
    cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=8"])
    bill = compute_bill(cfg, 8)
    assert bill.feature_scratch == {} and "moe_dispatch" not in bill.activations_by_name
    assert "router_proj" not in costmodel._op_flops(cfg, 1024)


def test_explain_files_a_device_s_per_expert_copies_under_ep():
    from jaxmem.moe.explain import moe_kind

    op = "jit(step)/ckpt.expert_gate/dot_general"
    fsdp8, ep8 = _qwen(), _qwen("parallel.fsdp=1", "parallel.ep=8")
    assert moe_kind(fsdp8, [128, 65536, 2048], None, op) == "moe_expanded"
    assert moe_kind(ep8, [16, 65536, 2048], None, op) == "moe_expanded"  # 128 / 8 experts a device
    assert moe_kind(fsdp8, [16, 65536, 2048], None, op) == "moe_dispatch"
    mixtral_ep8 = load_config("configs/tiny.yaml", QWEN[1:] + ["model.preset=mixtral-8x7b", "model.n_layers=2",
                                                              "parallel.fsdp=1", "parallel.ep=8"])
    assert moe_kind(mixtral_ep8, [1, 4096, 8192], None, op) == "moe_dispatch"  # one expert a device: no copies
