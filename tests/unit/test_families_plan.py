"""The analytic bill and the cost model know the new shapes: explicit head_dim, q/k norms, four norms,
windowed attention FLOPs."""
import pytest

from jaxmem.loader import load_config
from jaxmem.model.presets import param_count
from jaxmem.plan import costmodel


def _cfg(preset, seq, attention="pallas"):
    return load_config("configs/tiny.yaml", [f"model.preset={preset}", f"train.seq_len={seq}",
                                             f"model.max_seq_len={seq}", f"kernels.attention={attention}"])


def test_windowed_attention_flops_count_the_window_on_local_layers():
    cfg = _cfg("gemma3-12b", 8192)
    tokens = 8192
    m = cfg.model
    assert (m.n_layers, m.sliding_window, m.global_every) == (48, 1024, 6)
    # 40 local layers see 1024 keys per query (unmasked convention), 8 global ones all 8192
    keys = (40 * 1024 + 8 * 8192) / 48
    ops = costmodel._op_flops(cfg, tokens)
    assert ops["attention"] == pytest.approx(4.0 * tokens * keys * 16 * 256)
    # the flash kernel: the causal triangle on global layers, the band on local ones
    band = 8192 * 1024 - 1024 * 1023 / 2
    triangle = 8192 * 8192 / 2
    assert costmodel._flash_attention_fwd(cfg, tokens) == pytest.approx(
        4.0 * 16 * 256 * (40 * band + 8 * triangle) / 48)


def test_a_model_without_window_keeps_the_causal_half():
    cfg = _cfg("qwen3-8b", 4096)
    ops = costmodel._op_flops(cfg, 4096)
    assert ops["attention"] == pytest.approx(4.0 * 4096 * 4096 * 32 * 128)
    assert costmodel._flash_attention_fwd(cfg, 4096) == pytest.approx(ops["attention"] / 2)


def test_window_cuts_the_estimated_attention_time_only_for_flash_kernels():
    from jaxmem.plan.bill import compute_bill
    from jaxmem.config.targets import get_target

    gpu = get_target("h100-80g")
    for attention, cheaper in (("pallas", True), ("xla", False)):
        times = []
        for window in (0, 1024):
            cfg = load_config("configs/tiny.yaml", [
                "model.preset=gemma3-12b", "train.seq_len=8192", "model.max_seq_len=8192", "train.micro_batch=1",
                f"kernels.attention={attention}", f"model.sliding_window={window}",
                f"model.global_every={6 if window else 0}", "parallel.fsdp=8", "remat.preset=full"])
            bill = compute_bill(cfg, 8)
            times.append(costmodel.time_breakdown(cfg, bill, gpu, 8, 1, 1)["attention_kernel_flops"])
        assert (times[1] < 0.5 * times[0]) if cheaper else times[1] == times[0]


def test_bill_counts_the_new_parameters():
    from jaxmem.plan.bill import compute_bill

    for preset in ("qwen3-8b", "gemma3-12b"):
        cfg = load_config("configs/tiny.yaml", [f"model.preset={preset}", "train.seq_len=1024",
                                                "parallel.fsdp=8", "precision.param_dtype=bfloat16"])
        bill = compute_bill(cfg, 8)  # bf16 params sharded 8 ways (a dim that does not split evenly pads)
        assert bill.device["params"] * 8 / 2 == pytest.approx(param_count(cfg.model), rel=2e-3)


def test_without_remat_the_bill_keeps_the_extra_norm_outputs():
    from jaxmem.plan.bill import compute_bill

    def saved(preset, **extra):
        overrides = [f"model.preset={preset}", "train.seq_len=1024", "parallel.fsdp=8", "remat.preset=none"]
        cfg = load_config("configs/tiny.yaml", overrides + [f"model.{k}={v}" for k, v in extra.items()])
        return compute_bill(cfg, 8).device["activations"]

    # q/k norms add their fp32 inputs and normed outputs (q + kv heads); post-norms two of each per layer
    assert saved("qwen3-8b") > saved("qwen3-8b", qk_norm="false")
    assert saved("gemma3-12b") > saved("gemma3-12b", post_norms="false")
