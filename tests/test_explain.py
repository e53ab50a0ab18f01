"""`jaxmem explain`: buffers at the peak of a deviceless compile, attributed to jaxmem source lines and
classified by what they are (their producer's phase and their shape against the train state).

One deviceless compile (8 x h100-80g) serves every test here: the dump is kept and re-read with
`explain_dump`, and the OOM hook's compile is pointed at it.
"""
import json
import math
import shutil

import pytest

from jaxmem.plan import explain as explain_mod
from jaxmem.config import load_config
from jaxmem.plan.buffer_kinds import CATEGORIES, SUGGESTIONS, classify, state_shapes
from jaxmem.plan.explain import explain_dump, is_oom, main, report_oom
from jaxmem.plan import hlo_dump

# Tiny model, naive loss with a big vocab (the [tokens, vocab] fp32 logits rank first), selective remat (named
# scan residuals), and two micro-batches: the fp32 gradient accumulators are live during the second one's
# backward pass, next to its logits and residuals, and XLA allocates the optimizer update's output buffers
# before that peak, so the peak holds every kind of buffer.
OVERRIDES = ["parallel.fsdp=8", "model.vocab_size=32768", "train.seq_len=256", "kernels.loss=naive",
             "remat.preset=selective", "train.grad_accum=2", "target.name=h100-80g"]
TOP = 100  # every buffer at the peak (about 80)
L, D, F, V, T, B = 4, 128, 352, 32768, 256, 2  # tiny preset; micro_batch 2 rows per device
FSDP = 8


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tiny.yaml", OVERRIDES)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """(report, dump dir): the CLI run once, its XLA dump kept."""
    tmp = tmp_path_factory.mktemp("explain")
    out, dump = tmp / "top.json", tmp / "dump"
    assert main(["configs/tiny.yaml", *OVERRIDES, "--top", str(TOP), "--json", str(out),
                 "--dump-dir", str(dump)]) == 0
    return json.loads(out.read_text()), dump


@pytest.fixture(scope="module")
def report(dumped):
    return dumped[0]


@pytest.fixture(scope="module")
def module(dumped):
    hlo, _, _ = hlo_dump.find_dump(dumped[1])
    return hlo_dump.HloModuleText(hlo.read_text())


def _is(b, shape, dtype="f32"):
    return b["shape"] == list(shape) and b["dtype"] == dtype


def _argument(b):
    return b["op"].startswith(("state[", "batch"))


def test_naive_loss_logits_rank_first_and_point_at_the_loss_code(report):
    top = report["buffers"][0]
    tokens = B * T
    assert top["category"] == "logits"
    assert _is(top, (tokens, V)) and top["bytes"] == tokens * V * 4
    assert top["source"].startswith("jaxmem/kernels/cross_entropy/reference.py:")
    assert "kernels.loss=chunked" in top["suggestion"]


def test_every_buffer_has_the_documented_fields(report):
    r = report
    assert r["label"] == "compiled for 8 x h100-80g (deviceless)"
    assert 40 < len(r["buffers"]) < TOP  # all of them
    sizes = [b["bytes"] for b in r["buffers"]]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == r["peak_live_bytes"]
    for b in r["buffers"]:
        assert {"buffer", "bytes", "shape", "dtype", "category", "checkpoint_name", "source", "op", "why",
                "suggestion"} <= set(b)
        assert b["category"] in CATEGORIES and b["suggestion"] and b["why"]
        if b["dtype"] in ("f32", "s32"):
            assert b["bytes"] == 4 * math.prod(b["shape"]), b


def test_the_peak_holds_each_kind_and_each_is_named_for_what_it_is(report):
    """Params and optimizer state are the step's arguments; fp32 weight-shaped buffers are gradients when
    the gradient computation wrote them and optimizer temporaries when the update did, never activations."""
    bufs = report["buffers"]
    by_cat = {c: [b for b in bufs if b["category"] == c] for c in CATEGORIES}

    # the train state: parameters and Adam's moments, as this device's FSDP shards
    assert any(_is(b, (L, D // FSDP, F)) and b["op"] == "state['params']['layers']['w_gate']" for b in by_cat["param"])
    assert all(b["op"].startswith(("state['opt']", "state['master']")) for b in by_cat["optimizer"]
               if _argument(b))
    for b in bufs:
        if b["op"].startswith("state['params']"):
            assert b["category"] == "param", b
        elif b["op"].startswith("state['opt']"):
            assert b["category"] == "optimizer", b

    # gradients: the fp32 micro-batch accumulators, shaped like the stacked weight shards
    grads = [b for b in by_cat["grad"] if _is(b, (L, D // FSDP, F)) or _is(b, (L, F // FSDP, D))]
    assert grads, [(b["shape"], b["category"], b["why"]) for b in bufs]
    assert all("grads/" in b["op"] and not _argument(b) for b in grads)
    assert any(_is(b, (V // FSDP, D)) for b in by_cat["grad"])  # the embedding's (sharded over the vocab)
    assert any(_is(b, (D // FSDP, V)) for b in by_cat["grad"])  # the LM head's (sharded over d_model)

    # optimizer temporaries: weight-shaped fp32 buffers the update writes (its new-state/param buffers)
    temps = [b for b in by_cat["optimizer"] if not _argument(b)]
    assert temps and all(b["suggestion"] == SUGGESTIONS["optimizer_temp"] and "optimizer update" in b["why"]
                         for b in temps), [(b["shape"], b["why"]) for b in temps]
    assert any(_is(b, (L, D // FSDP, F)) or _is(b, (L, F // FSDP, D)) for b in temps)
    for b in temps:
        if len(b["shape"]) >= 2:  # the update loop's buffers: its name scope and optim.py
            assert "optimizer_update/" in b["op"] and b["source"].startswith("jaxmem/optim.py:"), b

    # activations: the per-layer values the forward scan keeps, [L, B, T, ...]
    acts = by_cat["activation"]
    assert any(_is(b, (L, B, T, F)) and b["checkpoint_name"] in ("mlp_gate", "mlp_up") for b in acts)
    assert all(b["shape"][:3] == [L, B, T] or b["shape"][:2] == [B, T] for b in acts), acts

    # logits: [tokens, vocab] fp32 (the loss and its gradient)
    assert all(_is(b, (B * T, V)) for b in by_cat["logits"]) and by_cat["logits"]

    # the issue: no weight-shaped buffer is called an activation
    weights = {(L, D // FSDP, F), (L, F // FSDP, D), (L, D, F), (L, F, D), (D // FSDP, F), (F // FSDP, D),
               (V // FSDP, D), (D // FSDP, V), (D, V), (V, D)}
    for b in bufs:
        if tuple(b["shape"]) in weights:
            assert b["category"] in ("param", "grad", "optimizer"), b


def test_scan_residuals_are_activations_with_their_checkpoint_name(report):
    acts = [b for b in report["buffers"] if b["category"] == "activation"]
    assert acts, [(b["category"], b["source"]) for b in report["buffers"]]
    named = {b["checkpoint_name"] for b in acts}
    assert named & {"mlp_gate", "mlp_up", "query_proj", "key_proj", "value_proj", "attn_context", "attn_out",
                    "mlp_out", "layer_input"}, named
    assert all(b["source"].startswith("jaxmem/") for b in acts)


def test_every_weight_shaped_op_of_the_update_and_backward_pass_is_classified_by_phase(cfg, module):
    """Beyond the peak: each weight-shaped value the update writes is an optimizer buffer, each one the
    backward pass writes is a gradient (or an all-gathered weight), whatever source line it carries."""
    state = state_shapes(cfg, module)
    seen = {"optimizer": 0, "grad": 0}
    for ins in module.instrs.values():
        if ins.type.startswith("(") or ins.opcode in ("parameter", "get-tuple-element", "bitcast", "constant"):
            continue
        shape = hlo_dump.parse_array_type(ins.type)[1]
        if not state.weight(shape) or state.token_shaped(shape):
            continue
        got = classify(cfg, module, ins.name, "{}", 0, state)
        if "optimizer_update/" in ins.op_name:
            assert got["category"] == "optimizer", (ins.name, ins.op_name, got)
            seen["optimizer"] += 1
        elif "transpose(" in ins.op_name:
            # a gradient, or the weights the backward pass reads: gathered, sliced or cast from state['params']
            assert got["category"] == "grad" or got["category"] == "param" and (
                got["why"].startswith("all-gather") or "copy of state['params']" in got["why"]), \
                (ins.name, ins.op_name, got)
            seen["grad"] += got["category"] == "grad"
    assert seen["optimizer"] and seen["grad"], seen


def test_explain_dump_rereads_a_dump_without_compiling(cfg, dumped, report):
    again = explain_dump(cfg, dumped[1], top=5)
    assert [b["buffer"] for b in again["buffers"]] == [b["buffer"] for b in report["buffers"][:5]]
    assert again["peak_live_bytes"] == report["peak_live_bytes"]


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

%b (q: (s32[], f32[4,2,8])) -> (s32[], f32[4,2,8]) {
  %q = (s32[], f32[4,2,8]{2,1,0}) parameter(0)
  %g = f32[4,2,8]{2,1,0} get-tuple-element(%q), index=1
  ROOT %u = (s32[], f32[4,2,8]{2,1,0}) tuple(%g, %g)
}

ENTRY %main (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0), metadata={op_name="state[\\'params\\'][\\'x\\']"}
  %t = (s32[], f32[4,2,8]{2,1,0}, bf16[3]{0}) tuple(%p, %p, %p)
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
    # what the classifier walks: the entry computation, loop bodies and their callers, users, tuple indices
    assert mod.entry == "main" and mod.instrs["p"].op_name == "state['params']['x']"
    assert w.calls == ("c", "b") and mod.callers["b"] == ["w"] and mod.roots["b"] == "u"
    assert mod.instrs["g"].tuple_index == 1 and mod.instrs["q"].computation == "b"
    assert mod.users["p"] == ["t", "r"] and mod.users["t"] == ["w"] and mod.computations["b"] == ["q", "g", "u"]


def test_oom_hook_ignores_other_errors():
    cfg = load_config("configs/tiny.yaml")
    assert not report_oom(cfg, ValueError("shape mismatch"))
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB"))


def test_oom_hook_prints_the_explain_report(cfg, dumped, monkeypatch):
    import io

    # The hook's deviceless compile is the module's (same config): reuse its dump instead of compiling again.
    calls = []

    def reuse(cfg_, topo, dump_dir):
        calls.append(topo.label)
        shutil.copytree(dumped[1], dump_dir, dirs_exist_ok=True)

    monkeypatch.setattr(explain_mod, "compile_with_dumps", reuse)
    out = io.StringIO()
    assert report_oom(cfg, RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 9 GiB"), top=3, file=out)
    text = out.getvalue()
    assert calls == ["8 x h100-80g"]
    assert "buffers live at the peak" in text and "compiled for 8 x h100-80g (deviceless)" in text
    assert "logits" in text and "could not explain" not in text
