"""A mixture of experts planned deviceless (8 x h100-80g): the analytic bill within 10% of XLA's device total,
and `jaxmem explain` names the routed rows' buffers (one compile, shared through built_once)."""
import json

import pytest

from jaxmem.config import load_config
from jaxmem.plan import bill_moe
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.explain import main

OVERRIDES = ["target.name=h100-80g", "target.gpus_per_host=8", "remat.preset=full", "precision.param_dtype=bfloat16",
             "precision.compute_dtype=bfloat16", "precision.master_weights=true"]
E, ROWS = 8, 16 * 64 * 2  # tiny-moe: 8 experts; 16 rows of 64 tokens per micro-batch, top 2


@pytest.fixture(scope="module")
def report(built_once):
    def build(directory):
        assert main(["configs/tiny-moe.yaml", *OVERRIDES, "--top", "20", "--json", str(directory / "top.json")]) == 0

    return json.loads((built_once("moe_explain", build) / "top.json").read_text())


def test_bill_is_within_ten_percent_of_the_compiled_total(report):
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES)
    bill = compute_bill(cfg, 8)
    compiled = report["compiled_device_bytes"]
    assert bill.device_total == pytest.approx(compiled, rel=0.10)
    # the routed rows' copies are most of it: the bill without them would be a fifth of the step
    assert bill.moe_scratch > 0.5 * compiled
    assert bill_moe.routed_rows(cfg, bill.layout) == ROWS


def test_explain_names_the_routed_rows(report):
    buffers = report["buffers"]
    expanded = [b for b in buffers if b["why"].startswith("MoE per-expert copy")]
    assert expanded and expanded[0] is buffers[0]  # the largest buffer at the peak
    for b in expanded:
        assert E in b["shape"][:2] and ROWS in b["shape"] and b["category"] == "temp"
        assert "parallel.ep" in b["suggestion"]
    rows = [b for b in buffers if b["why"].startswith("MoE dispatch rows")]
    assert rows and all(ROWS in b["shape"] for b in rows)
    assert {b["checkpoint_name"] for b in rows} & {"moe_dispatch", "expert_gate", "expert_up", "expert_act",
                                                   "expert_out"}
    # none of them filed as [tokens, vocab] logits (tiny-moe's d_model is half its vocabulary)
    assert not [b for b in expanded + rows if b["category"] == "logits"]
