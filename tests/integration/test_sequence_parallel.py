"""Sequence parallelism (parallel.sp) and sequence tiling (remat.seq_tile): the loss and every gradient equal
one device's, with and without packed documents; tiling shrinks the compiled working set; bad layouts are
refused by name before anything compiles."""
import json

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError, to_dict

from jaxmem.loader import load_config
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

# 8 query heads, 2 kv heads of width 16: sp=8 needs each kv head repeated 4 times; sp=2 splits them as is
HEADS = ["model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=16"]
SEQ = 64
# Three documents per row (20 + 30 + 14 tokens), positions restarting in each.
DOCS = (20, 30, 14)


def _batch(rows: int, packed: bool):
    tokens = np.random.default_rng(0).integers(0, 256, (rows, SEQ + 1)).astype(np.int32)
    if not packed:
        return tokens, None, None
    seg = np.concatenate([np.full(n, i) for i, n in enumerate(DOCS)])[None].repeat(rows, 0).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in DOCS])[None].repeat(rows, 0).astype(np.int32)
    return tokens, seg, pos


_PROGRAMS: dict = {}


def _program_and_params(overrides, devices):
    """The program and its initial params, built once per layout: its packed and unpacked runs share them."""
    key = (tuple(overrides), tuple(devices))
    if key not in _PROGRAMS:
        cfg = load_config("configs/tiny.yaml", [f"train.seq_len={SEQ}"] + HEADS + overrides)
        prog = build_program(cfg, devices=devices)
        _PROGRAMS[key] = prog, prog.init_state(seed=0)["params"]
    return _PROGRAMS[key]


def _loss_and_grads(overrides, devices, packed, with_hlo=False):
    prog, params = _program_and_params(overrides, devices)
    tokens, seg, pos = _batch(prog.rows, packed)
    loss_sum = loss_sum_fn(prog)
    fn = jax.jit(jax.value_and_grad(lambda p: loss_sum(p, tokens[:, :-1], tokens[:, 1:], seg, pos)[0]))
    loss, grads = fn(params)
    hlo = fn.lower(params).compile().as_text() if with_hlo else ""
    return float(loss), jax.device_get(grads), hlo


_REFERENCES: dict = {}


def _one_device(rows: int, packed: bool, extra=()):
    overrides = ["parallel.fsdp=1", f"train.micro_batch={rows}", *extra]
    # keyed by the resolved config: overrides that restate a default (remat.preset=none) share the reference
    key = (packed, json.dumps(to_dict(load_config("configs/tiny.yaml", [f"train.seq_len={SEQ}"] + HEADS + overrides))))
    if key not in _REFERENCES:
        _REFERENCES[key] = _loss_and_grads(overrides, jax.devices()[:1], packed)
    return _REFERENCES[key]


LAYOUTS = {  # name: (overrides, global rows)
    "sp2_fsdp4": (["parallel.sp=2", "parallel.fsdp=4", "train.micro_batch=1"], 4),
    "sp4_fsdp2_pallas": (["parallel.sp=4", "parallel.fsdp=2", "train.micro_batch=2", "kernels.attention=pallas",
                          "kernels.loss=pallas"], 4),
    "sp8": (["parallel.sp=8", "parallel.fsdp=1", "train.micro_batch=2"], 2),
    "sp2_fsdp2_tp2": (["parallel.sp=2", "parallel.fsdp=2", "parallel.tp=2", "parallel.rules=fsdp_tp",
                       "train.micro_batch=2"], 4),
    "sp4_fsdp2_tiled": (["parallel.sp=4", "parallel.fsdp=2", "train.micro_batch=1", "remat.preset=full",
                         "remat.seq_tile=8"], 2),
}


def _assert_same(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=2e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sequence_parallel_matches_one_device(name, packed):
    overrides, rows = LAYOUTS[name]
    got = _loss_and_grads(overrides, jax.devices(), packed, with_hlo=not packed)
    _assert_same(got, _one_device(rows, packed))
    if not packed:  # Ulysses: attention inputs change split (sequence -> heads) through all-to-alls
        assert "all-to-all" in got[2]


def test_packed_documents_change_the_loss():
    """The packed reference really is different from the unpacked one (the comparisons above see segments)."""
    assert abs(_one_device(2, True)[0] - _one_device(2, False)[0]) > 1e-3


def test_heads_that_do_not_split_gather_kv_with_plain_attention():
    """4 query heads over sp=8: queries stay split along the sequence and k, v are gathered (XLA only)."""
    got = _loss_and_grads(["parallel.sp=8", "parallel.fsdp=1", "train.micro_batch=2", "model.n_heads=4",
                           "model.head_dim=32"], jax.devices(), True)
    _assert_same(got, _one_device(2, True, ["model.n_heads=4", "model.head_dim=32"]))


@pytest.mark.parametrize("preset", ["none", "full", "offload_layer_inputs", "selective"])
def test_sequence_tiling_matches_untiled(preset):
    """Each preset in tiles against the one untiled step without recomputation (the packed reference the layouts
    above share): the tiles and the preset's recomputation together change nothing."""
    tiled = _loss_and_grads(["parallel.fsdp=1", "train.micro_batch=2", "remat.seq_tile=16", f"remat.preset={preset}"],
                            jax.devices()[:1], True)
    _assert_same(tiled, _one_device(2, True))


def _cpu_temp_bytes(tile: int) -> tuple[int, object]:
    from jaxmem.plan.bill import compute_bill

    cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=1", "train.micro_batch=1", "train.seq_len=2048",
                                            "model.max_seq_len=2048", "model.d_ff=16384", "model.n_layers=1",
                                            "remat.preset=full", f"remat.seq_tile={tile}"])
    prog = build_program(cfg, devices=jax.devices()[:1])
    temp = prog.lower().compile().memory_analysis().temp_size_in_bytes
    return temp, compute_bill(cfg, 1, gpu=False)


def test_sequence_tiling_shrinks_the_compiled_working_set():
    """Measured on CPU (XLA's buffer assignment): with 256-token tiles the [T, d_ff] MLP intermediates exist a
    tile at a time; the analytic bill's working set moves the same way."""
    whole, whole_bill = _cpu_temp_bytes(0)
    tiled, tiled_bill = _cpu_temp_bytes(256)
    btf = 2048 * 16384 * 4  # one [T, d_ff] fp32 intermediate
    assert whole - tiled > 3 * btf, (whole, tiled)
    saved = whole_bill.device["working_set"] - tiled_bill.device["working_set"]
    assert saved > 3 * btf, saved
    assert tiled_bill.layout.saved["mlp_gate"] == "remat"


def test_bill_splits_activations_over_sp():
    from jaxmem.plan.bill import compute_bill

    base = ["model.preset=llama3-8b", "model.max_seq_len=524288", "train.seq_len=524288", "train.micro_batch=1",
            "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "remat.preset=offload_layer_inputs",
            "kernels.attention=pallas", "parallel.fsdp=1"]
    one = compute_bill(load_config(None, base), 1)
    eight = compute_bill(load_config(None, base + ["parallel.sp=8"]), 8)
    layer_input = 524288 * 4096 * 2 * 32  # bf16 [T, D] per layer, offloaded
    assert one.host["activations"] == layer_input
    assert eight.host["activations"] == layer_input // 8
    assert eight.device["params"] == pytest.approx(one.device["params"] / 8, rel=1e-3)  # ZeRO-3 over sp


@pytest.mark.parametrize("overrides,key", [
    (["parallel.sp=3", "parallel.fsdp=1"], "parallel.sp: 3 does not divide train.seq_len=64"),
    (["parallel.sp=8", "parallel.fsdp=1", "model.n_heads=4", "model.head_dim=32", "kernels.attention=pallas"],
     "parallel.sp: model.n_heads=4 does not split over tp x sp = 8"),
    (["parallel.sp=2", "parallel.fsdp=4", "remat.seq_tile=24"], "remat.seq_tile: 24 does not divide"),
    (["remat.seq_tile=-1"], "remat.seq_tile: must be >= 0"),
    (["parallel.sp=0"], "parallel.sp: must be a positive size or -1"),
])
def test_bad_sequence_layouts_are_refused_by_name(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        cfg = load_config("configs/tiny.yaml", [f"train.seq_len={SEQ}", "train.micro_batch=1"] + HEADS + overrides)
        build_program(cfg, devices=jax.devices()[:3] if "sp=3" in overrides[0] else jax.devices())


def _h100x8_device_bytes(tile: int) -> tuple[int, str]:
    from jaxmem.runtime import aot
    from jaxmem.runtime.compiled_memory import memory_figures

    cfg = load_config(None, ["model.preset=llama3-8b", "model.n_layers=1", "train.seq_len=131072",
                             "model.max_seq_len=131072", "train.micro_batch=1", "precision.param_dtype=bfloat16",
                             "precision.compute_dtype=bfloat16", "parallel.fsdp=1", "parallel.sp=8",
                             "remat.preset=full", f"remat.seq_tile={tile}", "kernels.attention=pallas"])
    compiled = build_program(cfg, devices=aot.target_devices("h100-80g", 8)).lower().compile()
    return memory_figures(compiled)["device"], compiled.as_text()


@pytest.mark.slow
def test_deviceless_h100x8_sequence_parallel_pallas_step():
    """The real step with sp=8 and the Triton flash kernel builds for 8 x H100 (one Llama-3-8B layer at
    131072 tokens): all-to-alls in the HLO, and 2048-token tiles lower the compiled device total."""
    pytest.importorskip("jax_cuda12_plugin")
    whole, hlo = _h100x8_device_bytes(0)
    tiled, _ = _h100x8_device_bytes(2048)
    assert "all-to-all" in hlo
    assert tiled < whole - 0.5 * 2**30, (whole / 2**30, tiled / 2**30)
