"""A mixture of experts planned deviceless (8 x h100-80g): the analytic bill within 10% of XLA's device total
with the default grouped matmul (blocked), and the expert-parallel step holds the all-to-all buffers the bill's
capacity rule sizes (one compile each, shared through built_once)."""
import math

import pytest

from moe_explain import EP8, OVERRIDES, explained

from jaxmem.loader import load_config
from jaxmem.moe import bill as bill_moe
from jaxmem.plan.bill import compute_bill

pytestmark = pytest.mark.slow  # MoE steps compiled deviceless, shared by every test here

D, ROWS = 128, 16 * 64 * 2  # tiny-moe: d_model 128; 16 rows of 64 tokens per micro-batch, top 2


@pytest.fixture(scope="module")
def report(built_once):
    return explained(built_once, "moe_explain_blocked", [])[0]


@pytest.fixture(scope="module")
def report_ep8(built_once):  # test_expert_parallel reads the HLO of the same compile
    return explained(built_once, "moe_explain_ep8_capacity", EP8)[0]


def test_bill_is_within_ten_percent_of_the_compiled_total(report):
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES)
    bill = compute_bill(cfg, 8)
    assert bill_moe.grouped_matmul_kernel(bill.layout) == "blocked"
    compiled = report["compiled_device_bytes"]
    assert bill.device_total == pytest.approx(compiled, rel=0.10)
    assert bill_moe.routed_rows(cfg, bill.layout) == ROWS
    # without ragged_dot's dense copies the kernel's scratch is a minor part of the step (it was 3/4 of it)
    assert 0 < bill.feature_scratch.get("moe", 0) < 0.5 * compiled


def test_the_blocked_kernel_holds_padded_rows_not_dense_copies(report):
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES)
    layout = compute_bill(cfg, 8).layout
    block, chunk, padded = bill_moe.blocked_plan(cfg, layout, D, 96, 2)
    # 2048 rows over 8 experts: at most 16 + 7 blocks of 128, in chunks of 16 (MAX_CHUNK_BLOCKS): 32 blocks
    assert (block, chunk, padded) == (128, 16, 4096)
    buffers = report["buffers"]
    assert not [b for b in buffers if b["why"].startswith("MoE per-expert copy")]
    padded_rows = [b for b in buffers if b["shape"][-1] == D and math.prod(b["shape"][:-1]) == padded
                   and "grouped_matmul" in (b["source"] or "")]
    assert padded_rows and padded_rows[0]["dtype"] == "bf16"
    # one loop step's fp32 input-gradient chunk [chunk, block, D]
    assert [b for b in buffers if b["shape"] == [chunk, block, D] and b["dtype"] == "f32"]


def test_expert_parallel_buffers_are_the_capacity_rules(report_ep8):
    cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + EP8)
    layout = compute_bill(cfg, 8).layout
    # each device routes its own 2 x 64 tokens; C = ceil(1.25 x 128 x 2 / 8) = 40 rows per peer
    assert bill_moe.tokens_per_device(cfg, layout) == 128
    assert bill_moe.peer_capacity(cfg, layout) == 40
    assert bill_moe.routed_rows(cfg, layout) == 8 * 40
    shapes = [b["shape"] for b in report_ep8["buffers"]]
    assert [8, 40, D] in shapes  # the all-to-all buffer [ep, C, D]
    dispatched = [b for b in report_ep8["buffers"] if b["checkpoint_name"] == "moe_dispatch"]
    assert dispatched and dispatched[0]["shape"] == [8 * 40, D]  # the received rows sorted by local expert
