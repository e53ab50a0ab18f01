"""scripts/bench_everyday.py plans its rows through one function; here on tiny shapes (deviceless H100)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the recipes compiled deviceless, shared by every test here

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_everyday", ROOT / "scripts/bench_everyday.py")
ev = sys.modules["bench_everyday"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ev)

PEER = ev.Peer("a peer", "its table", 1.0, "GB", True, "same recipe")


def _tiny(name, method, adapters="", remat="full", peer=None):
    return ev.Recipe(name, "tiny", method, remat, 128, 2, 1, 80, adapters, ("model.n_layers=2",), peer)


@pytest.fixture(scope="module")
def rows():
    # the three recipes whose state the ordering below compares; a QLoRA recipe plans through the same plan_row
    # (only its overrides differ, checked without a compile in test_recipes_differ_as_their_state_does), and a
    # QLoRA step is compiled deviceless for an H100 by test_bill_attention_phase
    recipes = [_tiny("full", "full", peer=PEER), _tiny("lora-qv", "lora", "q,v"), _tiny("lora-all", "lora", "all")]
    return {r.name: ev.plan_row(r) for r in recipes}


def test_rows_carry_compiled_analytic_and_revision(rows):
    for row in rows.values():
        assert row["compiled_gib"] > 0 and row["analytic_gib"] > 0
        assert row["compiled_how"].startswith("compiled deviceless for 1 x h100-80g")
        assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", row["revision"])
    full = rows["full"]
    assert full["peer_gib"] == pytest.approx(1e9 / 2**30) and full["same_class"] is True


def test_recipes_differ_as_their_state_does(rows):
    # full fine-tuning holds an fp32 master and AdamW for every weight; adapters on q, v only hold fewer than
    # adapters on every linear; the compiled figures and the bills both see it
    for key in ("compiled_gib", "analytic_gib"):
        assert rows["lora-qv"][key] < rows["lora-all"][key] < rows["full"][key]
    assert "lora.targets=q_proj,v_proj" in rows["lora-qv"]["overrides"]
    assert "lora.base_dtype=bfloat16" in rows["lora-all"]["overrides"]
    assert "lora.base_dtype=nf4" in _tiny("qlora-all", "qlora", "all", remat="none").overrides()


def test_misses_and_markdown(rows):
    row = dict(rows["full"], compiled_gib=1.0, analytic_gib=1.2, peer_gib=1.2)
    assert ev.misses(row) == ["analytic", "peer"]  # 20% off the bill; 0.83x the peer
    assert ev.misses(dict(row, analytic_gib=1.05, peer_gib=1.25)) == []
    md = ev.render_md(list(rows.values()) + [{"recipe": "broken", "error": "boom", "revision": "x"}])
    assert "| full | 1 x h100-80g |" in md and "compile failed: boom" in md
    assert "1 rows failed to compile" in md and "a peer: its table" in md


def test_matrix_covers_the_issue():
    recipes = ev.RECIPES
    assert len(recipes) >= 24 and len({r.name for r in recipes}) == len(recipes)
    assert {r.method for r in recipes} == {"full", "lora", "qlora"}
    assert {"none", "selective", "full"} <= {r.remat for r in recipes}
    assert {r.gpu_gb for r in recipes} == {24, 48, 80} and {1, 8} <= {r.gpus for r in recipes}
    assert {"Llama-3-8B", "Qwen2.5-7B", "Mistral-7B"} <= {r.model for r in recipes}
    assert min(r.seq for r in recipes) == 512 and max(r.seq for r in recipes) == 8192
