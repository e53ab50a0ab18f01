"""`jaxmem explain`: buffers at the peak of a deviceless compile, attributed to jaxmem source lines."""
import json

import pytest

from jaxmem.aot import resolve_topology
from jaxmem.config import load_config
from jaxmem.explain import CATEGORIES, explain, is_oom, main, report_oom
from jaxmem.plan import hlo_dump

NAIVE_BIG_VOCAB = ["parallel.fsdp=8", "model.vocab_size=32768", "train.seq_len=256", "kernels.loss=naive",
                   "target.name=h100-80g"]


@pytest.fixture(scope="module")
def naive_loss_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain") / "top.json"
    assert main(["configs/tiny.yaml", *NAIVE_BIG_VOCAB, "--top", "6", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_naive_loss_logits_rank_first_and_point_at_the_loss_code(naive_loss_report):
    top = naive_loss_report["buffers"][0]
    tokens, vocab = 2 * 256, 32768  # micro_batch 2 rows per device x seq 256
    assert top["category"] == "logits"
    assert top["shape"] == [tokens, vocab] and top["dtype"] == "f32" and top["bytes"] == tokens * vocab * 4
    assert top["source"].startswith("jaxmem/kernels/cross_entropy/reference.py:")
    assert "kernels.loss=chunked" in top["suggestion"]


def test_every_buffer_has_the_documented_fields(naive_loss_report):
    r = naive_loss_report
    assert r["label"] == "compiled for 8 x h100-80g (deviceless)"
    assert len(r["buffers"]) == 6
    sizes = [b["bytes"] for b in r["buffers"]]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) <= r["peak_live_bytes"]
    for b in r["buffers"]:
        assert {"bytes", "shape", "dtype", "category", "source", "suggestion"} <= set(b)
        assert b["category"] in CATEGORIES and b["suggestion"]


def test_scan_residuals_are_activations_with_their_checkpoint_name(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=8", "remat.preset=selective", "train.seq_len=256",
                                            "target.name=h100-80g"])
    r = explain(cfg, resolve_topology(cfg), top=40)
    acts = [b for b in r["buffers"] if b["category"] == "activation"]
    assert acts, [(b["category"], b["source"]) for b in r["buffers"]]
    named = {b["checkpoint_name"] for b in acts}
    assert named & {"mlp_gate", "mlp_up", "query_proj", "key_proj", "value_proj", "attn_context", "attn_out",
                    "mlp_out", "layer_input"}, named
    assert all(b["source"].startswith("jaxmem/") for b in acts)


def test_hlo_text_parsing_of_tuples_and_frames():
    text = """HloModule m

FileNames
1 "/x/jaxmem/model/layers.py"

FunctionNames
1 "Block.mlp_part"

FileLocations
1 {file_name_id=1 function_name_id=1 line=81 end_line=81 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

ENTRY %main (p: f32[2]) -> f32[2] {
  %w = (s32[], f32[4,2,8]{2,1,0}, /*index=2*/bf16[3]{0}) while(%t), condition=%c, body=%b, \
metadata={op_name="jit(step)/while" stack_frame_id=1}
  ROOT %r = f32[2]{0} add(%p, %p)
}
"""
    mod = hlo_dump.HloModuleText(text)
    w = mod.instrs["w"]
    assert w.opcode == "while" and w.body == "b" and w.op_name == "jit(step)/while"
    assert hlo_dump.parse_array_type(hlo_dump.element_type(w.type, "{1}")) == ("f32", (4, 2, 8))
    assert hlo_dump.parse_array_type(hlo_dump.element_type(w.type, "{2}")) == ("bf16", (3,))
    frame = mod.stack(w.frame)[0]
    assert (frame.line, frame.function) == (81, "Block.mlp_part") and frame.file.endswith("layers.py")
    live = "  Live ranges at 7 (peak):\n    w{1}: 256 bytes (cumulative: 256 bytes)\n    r{}: 8 bytes (x)\n  end"
    assert hlo_dump.peak_buffers(live) == [("w", "{1}", 256), ("r", "{}", 8)]


def test_oom_hook_ignores_other_errors():
    cfg = load_config("configs/tiny.yaml")
    assert not report_oom(cfg, ValueError("shape mismatch"))
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB"))


def test_oom_hook_prints_the_explain_report():
    import io

    cfg = load_config("configs/tiny.yaml", ["target.name=h100-80g", "train.seq_len=128"])
    out = io.StringIO()
    assert report_oom(cfg, RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB"), top=3, file=out)
    text = out.getvalue()
    assert "buffers live at the peak" in text and "compiled for 8 x h100-80g (deviceless)" in text
    assert "could not explain" not in text
