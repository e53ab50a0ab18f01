"""The cost model's step time counts a preference reference's forward (reference=base or model: one forward of
the whole model per step over the step's tokens, at the dense matmul rate); precompute and the reference-free
objectives add nothing to the step (precompute's pass is the plan's preference section)."""
from __future__ import annotations

import pytest

from jaxmem.config.targets import get_target
from jaxmem.loader import load_config
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.costmodel import MATMUL_EFFICIENCY, estimate

H100 = get_target("h100-80g")
SEQ, ROWS = 64, 4


def _cost(*overrides):
    cfg = load_config("configs/tiny.yaml", ["train.objective=dpo", "data.kind=jsonl", "data.path=pairs.jsonl",
                                            "data.tokenizer=tokenizer.json", "data.format=preference", "lora.rank=8",
                                            "parallel.fsdp=1", "train.micro_batch=4", f"train.seq_len={SEQ}",
                                            *overrides])
    bill = compute_bill(cfg, 1, gpu=True)
    return cfg, estimate(cfg, bill, H100, 1, bill.layout.grad_accum, bill.layout.rows)


@pytest.mark.parametrize("overrides", [[], ["lora.rank=0", "preference.reference=model"]], ids=["base", "model"])
def test_the_reference_forward_is_in_the_step_time(overrides):
    cfg, with_ref = _cost(*overrides)
    _, without = _cost(*overrides[:1], "preference.reference=precompute")
    m = cfg.model
    d, n, k, h, f, v, layers = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff, m.vocab_size, m.n_layers
    t = ROWS * SEQ
    # by hand: 2 FLOPs per matmul weight (norm weights included, the embedding lookup not) and token, plus the
    # unmasked attention forward
    matmul_params = layers * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f + 2 * d) + d + v * d
    forward = 2 * matmul_params * t + 4 * t * SEQ * n * h * layers
    seconds = forward / (H100.peak_flops(cfg.precision.compute_dtype) * MATMUL_EFFICIENCY)
    assert with_ref.breakdown["extra_flops"] == pytest.approx(forward)
    assert with_ref.breakdown["extra_seconds"] == pytest.approx(seconds)
    assert without.breakdown["extra_seconds"] == 0.0
    assert with_ref.compute_seconds - without.compute_seconds == pytest.approx(seconds)
    assert with_ref.hardware_flops - without.hardware_flops == pytest.approx(forward)
    assert with_ref.model_flops == without.model_flops  # the reference trains nothing: not model work


def test_reference_free_objectives_add_no_forward():
    _, simpo = _cost("train.objective=simpo", "preference.reference=auto")
    assert simpo.breakdown["extra_flops"] == 0.0 and simpo.breakdown["extra_seconds"] == 0.0
