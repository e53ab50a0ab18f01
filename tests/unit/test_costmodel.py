"""The step-time cost model against the measured H100 train steps (benchmarks/calibration/h100_measured.json),
and its FLOP counting. Analytic only: no compiles."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jaxmem.loader import load_config
from jaxmem.plan.bill import compute_bill
from jaxmem.optim import states
from jaxmem.plan import costmodel
from jaxmem.plan.costmodel import estimate, time_breakdown
from jaxmem.config.targets import TARGETS, get_target

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_costmodel", ROOT / "scripts" / "bench_costmodel.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CASES = bench.load_cases()
H100 = TARGETS["h100-80g"]


def _case(name):
    return next(c for c in CASES if c["name"] == name)


def test_the_data_file_has_the_measured_rows():
    names = {c["name"] for c in CASES}
    assert {"1b_s8k_auto_sel", "1b_s8k_cudnn_sel", "8bx8L_s8k_sel", "8bx8L_4090style_s4k",
            "h200_qwen3moe_x4_s8k_full", "h200_mixtral_x2_s8k_full_blocked"} <= names
    for c in CASES:
        assert c["target"] in TARGETS and c["source"] and c["measured_step_seconds"] > 0
        if "measured_tokens_per_s" in c:
            assert c["measured_step_seconds"] == pytest.approx(c["tokens_per_step"] / c["measured_tokens_per_s"],
                                                               rel=1e-3)


@pytest.mark.parametrize("case", [c for c in CASES if not c.get("offload") and not c.get("known_miss")],
                         ids=lambda c: c["name"])
def test_step_time_within_25_percent_of_the_measured_step(case):
    [row] = bench.evaluate([case])  # also checks the resolved attention kernel against the data file
    assert row["attention"] == case["attention"]
    assert 0.75 <= row["ratio"] <= 1.25, row


def test_known_misses_are_where_benchmarks_costmodel_md_says():
    """The rows the model does not reach (known_miss in the data file): QLoRA 8B at seq 512 42% high, the
    QLoRA MoE step with the blocked grouped matmul 38% low. A change that moves them is a change to document."""
    ratios = {c["name"]: bench.evaluate([c])[0]["ratio"] for c in CASES if c.get("known_miss")}
    assert set(ratios) == {"h200_qlora_8b_qv_s512", "h200_qwen3moe_x4_s8k_qlora_blocked"}
    assert ratios["h200_qlora_8b_qv_s512"] == pytest.approx(1.42, abs=0.03)
    assert ratios["h200_qwen3moe_x4_s8k_qlora_blocked"] == pytest.approx(0.62, abs=0.03)


def test_expert_matmuls_run_at_the_grouped_matmul_rate_of_their_kernel():
    """Qwen3-30B-A3B widths x 4 layers, seq 8192, full remat: the k active experts' matmuls, by hand (gate, up,
    down: forward + 2 in the backward; the remat forward rebuilds gate and up), at the measured rate of the
    kernel at 512 rows per expert; the rest of the step does not depend on the kernel."""
    from jaxmem.moe.cost import GROUPED_MATMUL_EFFICIENCY_BY_SHAPE

    case = _case("h200_qwen3moe_x4_s8k_full")
    peak = TARGETS["h200-141g"].peak_flops("bfloat16")
    per_matmul = 2 * 8192 * 8 * 2048 * 768
    parts = {}
    for kernel in ("blocked", "pallas"):
        pinned = [o for o in case["pinned_overrides"] if "grouped_matmul" not in o]
        _, _, cost = bench.estimate_case({**case, "pinned_overrides": pinned + [f"kernels.grouped_matmul={kernel}"]})
        b = cost.breakdown
        assert b["grouped_matmul_kernel"] == kernel
        assert b["expert_matmul_flops"] == pytest.approx(4 * (3 * 3 + 2) * per_matmul)
        eff = GROUPED_MATMUL_EFFICIENCY_BY_SHAPE[kernel][(512, 2048, 768)]
        dense = (b["matmul_flops"] - b["expert_matmul_flops"]) / (peak * 0.7)
        assert b["matmul_seconds"] == pytest.approx(dense + b["expert_matmul_flops"] / (peak * eff), rel=1e-9)
        parts[kernel] = b
    for key in ("attention_seconds", "loss_seconds", "memory_bound_seconds", "layer_overhead_seconds"):
        assert parts["blocked"][key] == parts["pallas"][key]


def test_grouped_matmul_efficiency_takes_the_nearest_measured_shape():
    from jaxmem.moe.cost import grouped_matmul_efficiency as eff

    assert eff("pallas", 512, 2048, 768) == 0.183
    assert eff("pallas", 600, 2048, 768) == 0.183  # nearest: 512 rows per expert
    assert eff("pallas", 3000, 4096, 14336) == 0.425  # past the largest: the largest
    assert eff("blocked", 40, 2048, 768) == 0.018
    assert eff("ragged_dot", 512, 4096, 1536) == 0.0066  # one measured shape


def test_host_link_time_of_the_4090_recipe_within_25_percent_of_the_measured_step():
    case = _case("8bx8L_4090style_s4k")
    cfg, bill, cost = bench.estimate_case(case)
    measured = case["measured_step_seconds"]  # 1.86 s: PCIe-bound
    assert cost.host_link_seconds == pytest.approx(measured, rel=0.25)
    assert cost.step_seconds == pytest.approx(measured, rel=0.25)
    # the optimizer state (master, m, v: 12 bytes a parameter) crosses the link in AND out
    params = cost.params
    assert cost.breakdown["host_bytes_serial"] >= 2 * 12 * params


@pytest.mark.parametrize("case", [c for c in CASES if c.get("offload")], ids=lambda c: c["name"])
def test_offload_step_time_within_25_percent_of_the_measured_step(case):
    [row] = bench.evaluate([case])
    assert 0.75 <= row["ratio"] <= 1.25, row


def test_the_host_side_update_is_priced_per_trained_param():
    """Gemma 3 12B widths x 6 layers on one H200: 13.17 s per step with the AdamW update on the host CPU (the
    layer-scan update, the case's "host_update"), 1.21 s with the state streamed through the GPU (measured). The
    host's update is serial, per trained param, and the two estimates keep the measured ratio; the whole-tensor
    update the step runs now is priced at its own rate, per moment kind."""
    host, device = _case("h200_gemma3_x6_s8k_host_update"), _case("h200_gemma3_x6_s8k_device_update")
    assert host["host_update"] == "layer_scan"
    (cfg, bill, on_host), (_, _, streamed) = bench.estimate_case(host), bench.estimate_case(device)
    assert on_host.breakdown["host_update_seconds"] == pytest.approx(
        on_host.params * costmodel.LAYER_SCAN_HOST_UPDATE_SECONDS_PER_PARAM)
    now = costmodel.estimate(cfg, bill, get_target(host["target"]), 1, bill.layout.grad_accum, bill.layout.rows)
    assert now.breakdown["host_update_seconds"] == pytest.approx(
        on_host.params * states.moment_kind("float32").host_update_rate)
    assert streamed.breakdown["host_update_seconds"] == 0.0
    assert on_host.serial_host_seconds >= on_host.breakdown["host_update_seconds"]
    measured = host["measured_step_seconds"] / device["measured_step_seconds"]
    assert on_host.step_seconds / streamed.step_seconds == pytest.approx(measured, rel=0.25)


def test_offload_of_the_128k_recipe_is_counted_but_it_stays_compute_bound():
    case = _case("8bx4L_128k_1gpu")
    cfg, bill, cost = bench.estimate_case(case)
    assert cost.breakdown["host_bytes_serial"] == pytest.approx(2 * 12 * cost.params, rel=1e-6)
    assert cost.host_link_seconds < cost.compute_seconds
    assert cost.step_seconds == pytest.approx(case["measured_step_seconds"], rel=0.25)


def _cfg(preset, extra=()):
    return load_config("configs/tiny.yaml", ["parallel.fsdp=1", "model.preset=llama3.2-1b", "train.seq_len=8192",
                                             "train.micro_batch=1", f"remat.preset={preset}",
                                             "kernels.attention=pallas", *extra])


def test_recompute_flops_ordering_none_selective_full():
    costs = {}
    for preset in ("none", "selective", "full"):
        cfg = _cfg(preset)
        bill = compute_bill(cfg, 1, gpu=True)
        costs[preset] = estimate(cfg, bill, H100, 1, bill.layout.grad_accum, bill.layout.rows)
    assert costs["none"].recompute_flops == 0
    assert costs["none"].recompute_flops < costs["selective"].recompute_flops <= costs["full"].recompute_flops
    assert costs["none"].step_seconds < costs["selective"].step_seconds < costs["full"].step_seconds
    # same model FLOPs whatever the policy: recompute is hardware work, not model work
    assert costs["none"].model_flops == costs["selective"].model_flops == costs["full"].model_flops


def test_flops_and_kernel_work_by_hand_for_a_small_config():
    cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=1", "train.micro_batch=2", "train.seq_len=64",
                                            "remat.preset=full", "kernels.attention=cudnn", "kernels.loss=chunked"])
    m = cfg.model
    d, n, k, h, f, v, layers = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    t, s = 2 * 64, 64
    bill = compute_bill(cfg, 1, gpu=True)
    cost = estimate(cfg, bill, H100, 1, bill.layout.grad_accum, bill.layout.rows)
    proj = 2 * t * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f)  # q, k + v, o, gate + up + down
    head = 2 * t * d * v
    attn_unmasked = 4 * t * s * n * h
    assert cost.tokens_per_step == t
    # model FLOPs: 6 x matmul params (norm weights included, the embedding lookup not) x tokens + 3 x the
    # unmasked attention forward
    matmul_params = layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * d) + d + v * d
    assert cost.params == matmul_params + (0 if m.tie_embeddings else v * d)
    assert cost.model_flops == pytest.approx(6 * matmul_params * t + 3 * attn_unmasked * layers)
    # full remat reruns every forward matmul but the down projection (its output is never read back),
    # and the attention forward
    rerun = proj - 2 * t * f * d
    assert cost.recompute_flops == pytest.approx((rerun + attn_unmasked) * layers)
    b = time_breakdown(cfg, bill, H100, 1, 1, 2)
    assert b["matmul_flops"] == pytest.approx((3 * proj + rerun) * layers)
    # the kernel does causal work: half the unmasked FLOPs; fwd + bwd = 3.5 fwd, +1 fwd rerun
    assert b["attention_kernel_flops"] == pytest.approx(attn_unmasked / 2 * 4.5 * layers)
    # chunked loss: the backward recomputes the logits, 4 matmul passes
    assert b["loss_flops"] == pytest.approx(4 * head)
    assert cost.compute_seconds == pytest.approx(sum(b[x] for x in ("matmul_seconds", "attention_seconds",
                                                                     "loss_seconds", "memory_bound_seconds",
                                                                     "layer_overhead_seconds")))


def test_sequence_tiles_rerun_their_forward_in_the_step_time_too():
    """remat.seq_tile: each tile's projections and MLP run once more in the backward; the matmul FLOPs the
    step time prices grow by exactly the recompute FLOPs' growth (they once did not, so a tiled step's time
    was the untiled one's)."""
    runs = {}
    for tile in (0, 16):
        cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=1", "train.micro_batch=2", "train.seq_len=64",
                                                "remat.preset=full", f"remat.seq_tile={tile}"])
        bill = compute_bill(cfg, 1, gpu=True)
        runs[tile] = (estimate(cfg, bill, H100, 1, bill.layout.grad_accum, bill.layout.rows),
                      time_breakdown(cfg, bill, H100, 1, 1, 2))
    (plain, plain_parts), (tiled, tiled_parts) = runs[0], runs[16]
    m = load_config("configs/tiny.yaml").model
    t = 2 * 64
    # q, k + v, o, gate + up, down
    rerun = 2 * t * (m.d_model * m.n_heads * m.head_dim + 2 * m.d_model * m.n_kv_heads * m.head_dim
                     + m.n_heads * m.head_dim * m.d_model + 2 * m.d_model * m.d_ff + m.d_ff * m.d_model)
    assert tiled.recompute_flops - plain.recompute_flops == pytest.approx(rerun * m.n_layers)
    assert tiled_parts["matmul_flops"] - plain_parts["matmul_flops"] == pytest.approx(rerun * m.n_layers)
    assert tiled.step_seconds > plain.step_seconds


def test_cudnn_attention_takes_less_time_than_pallas():
    pallas, cudnn = _cfg("selective"), _cfg("selective", ["kernels.attention=cudnn"])
    tp = time_breakdown(pallas, compute_bill(pallas, 1), H100, 1, 1, 1)["attention_seconds"]
    tc = time_breakdown(cudnn, compute_bill(cudnn, 1), H100, 1, 1, 1)["attention_seconds"]
    assert tc < tp


def test_bench_script_writes_the_table(tmp_path):
    assert bench.main(["--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "costmodel.md").read_text()
    assert "measured s (measured on GPU)" in md and "estimated s (cost model)" in md and "within +-25%?" in md


def test_kernel_efficiencies_reproduce_the_measured_kernel_timings():
    """The per-kernel constants come from the data file's kernel rows (fwd + bwd on the H100; the grouped
    matmul's on the H200)."""
    import json

    from jaxmem.moe.cost import grouped_matmul_efficiency
    from jaxmem.plan.costmodel import ATTENTION_EFFICIENCY, CHUNKED_LOSS_EFFICIENCY_BY_TILE, LOSS_EFFICIENCY, LOSS_PASSES

    for row in json.loads(bench.DATA.read_text())["kernels"]:
        if row.get("superseded"):  # a kernel since rewritten or removed: kept in the data for the record
            continue
        peak = TARGETS[row.get("target", "h100-80g")].peak_flops("bfloat16")
        if row["op"] == "grouped_matmul":  # fwd + both gradients of the active rows; rates rounded to 3 digits
            flops = 6 * row["rows"] * row["d"] * row["f"]
            eff = grouped_matmul_efficiency(row["impl"], row["rows"] / row["groups"], row["d"], row["f"])
            t, tol = flops / (peak * eff), 0.035
        elif row["op"] == "attention":  # causal: half of 4 T S N H, fwd + bwd = 3.5 x fwd
            flops = 4 * row["batch"] * row["seq"] ** 2 * row["heads"] * row["head_dim"] / 2 * 3.5
            t, tol = flops / (peak * ATTENTION_EFFICIENCY[row["impl"]]), 0.15  # one rate for seq 8k and 32k
        else:
            flops = LOSS_PASSES[row["impl"]] * 2 * row["tokens"] * row["d_model"] * row["vocab"]
            eff = CHUNKED_LOSS_EFFICIENCY_BY_TILE[tuple(row["tile"])] if "tile" in row else LOSS_EFFICIENCY[row["impl"]]
            t, tol = flops / (peak * eff), row.get("rel_tolerance", 0.01)
        assert t == pytest.approx(row["measured_fwd_bwd_seconds"], rel=tol), row
