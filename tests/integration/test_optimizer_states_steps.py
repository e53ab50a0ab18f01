"""The optimizer state kinds step by step (issue 45): a few steps of a two-layer model stored as its kind, the
fsdp=8 step against the one-device step, the update on the host, in the backward and in pieces against the
plain one, stochastic rounding against an fp32 master's update, LoRA adapters' moments. The kinds, their rules,
short runs against fp32 AdamW, resumes and the planner are tests/integration/test_optimizer_states.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.optim import codes

from optim_checks import code_indices
from test_optimizer_states import BF16_SR, KINDS  # the kinds are defined once, with their runs

SMALL = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=16", "optimizer.warmup_steps=0",
         "optimizer.lr=1e-2"]


def _steps(overrides, devices=1, n=4):
    """(losses, final state) of n steps on fixed batches of 16 rows (the same global batch on any mesh)."""
    cfg = load_config(None, SMALL + [f"parallel.fsdp={devices}", f"train.micro_batch={16 // devices}"] + overrides)
    prog = build_program(cfg, devices=jax.devices()[:devices])
    state, step, losses = prog.init_state(), prog.jit_step(), []
    for i in range(n):
        tokens = np.random.default_rng(i).integers(0, 256, prog.batch_shape).astype(np.int32)
        state, m = step(state, prog.shard_batch(tokens))
        losses.append(float(m["loss"]))
    return losses, state


@pytest.mark.slow
def test_state_is_stored_as_its_kind():
    _, state = _steps(KINDS["int4"], n=1)
    m = state["opt"]["layers"][0].mu
    assert codes.is_quantized(m["w_up"]) and m["w_up"].codes.dtype == jnp.uint8 and m["w_up"].code == "dynamic4_signed"
    assert not codes.is_quantized(m["attn_norm"]) and m["attn_norm"].dtype == jnp.float32  # vectors stay fp32
    _, state = _steps(KINDS["float8"], n=1)
    v = state["opt"]["layers"][0].nu["w_up"]
    assert v.codes.dtype == jnp.float8_e4m3fn and v.code == "e4m3_unsigned" and v.block == 256
    _, state = _steps(KINDS["adafactor"] + BF16_SR, n=2)
    assert int(jax.tree.leaves(state["opt"]["rest"])[0]) == 2  # the step count adam_count reads
    factored = state["opt"]["layers"][0]
    assert factored.v_row["w_up"].dtype == factored.v_col["w_up"].dtype == jnp.float32  # not the bf16 params'
    assert factored.v_row["w_up"].shape == (2, 128) and factored.v_col["w_up"].shape == (2, 352)


# int8 moments and bf16 stochastic rounding are stepped together (int8_bf16_sr): the sharded codes and the
# sharded rounding bits in one program, under the rounded kinds' bounds
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int4", "float8", "adafactor", "int8_bf16_sr"])
def test_fsdp8_step_equals_the_one_device_step(kind):
    """The same four steps on one device and on an fsdp=8 mesh (state, codes and scales sharded like the
    weights): the same losses, and the same weights and stored state but where a last-bit difference of the
    sharded sums crossed a code boundary (then that value's next updates differ: a few weights and block scales
    in 1000, a few codes in 100)."""
    one, s1 = _steps(KINDS[kind])
    eight, s8 = _steps(KINDS[kind], devices=8)
    # bf16 weights rounded stochastically (no master): a last-bit difference of a sharded sum that lands on a
    # rounding threshold moves that weight a whole bf16 step (2^-8 of it), which the next steps carry into the
    # loss and the moments; the summation order, and so how many do, depends on the CPU's vector width
    rounded = kind in ("bf16_sr", "int8_bf16_sr")
    np.testing.assert_allclose(eight, one, rtol=6e-5 if rounded else 2e-5)

    def close(a, b):
        if codes.is_quantized(a):  # a crossing moves a code by a step (a block scale that moved: its block)
            step = np.abs(code_indices(a).astype(int) - code_indices(b).astype(int))
            far, near = (6e-2, 0.3) if rounded else (1e-2, 0.1)
            assert np.mean(step > 1) < far and np.mean(step > 0) < near, (np.mean(step > 1), np.mean(step > 0))
            a, b = a.scales, b.scales
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        off = ~np.isclose(a, b, rtol=2e-2, atol=1e-4)
        assert np.mean(off) < 1e-2 and np.max(np.abs(a - b), initial=0) < 0.05, (np.mean(off), np.max(np.abs(a - b)))

    jax.tree.map(close, s8["params"], s1["params"])
    jax.tree.map(close, s8["opt"], s1["opt"], is_leaf=codes.is_quantized)


@pytest.mark.slow
@pytest.mark.parametrize("where", [["offload.optimizer=host", "offload.optimizer_update=host"],
                                   ["offload.optimizer=host", "offload.optimizer_update=device"]],
                         ids=["update_on_host", "streamed"])
def test_host_resident_state_trains_as_on_the_device(where):
    """int8 moments and bf16 weights rounded stochastically, the state in pinned host memory: the update on the
    host (whole tensors) or streamed through the device gives the device update's numbers exactly."""
    kind = KINDS["int8_bf16_sr"]
    want, s_dev = _steps(kind, devices=2, n=3)
    got, s_host = _steps(kind + where, devices=2, n=3)
    assert got == want
    jax.tree.map(np.testing.assert_array_equal, s_host["params"], s_dev["params"])
    jax.tree.map(np.testing.assert_array_equal, s_host["opt"], s_dev["opt"])
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(s_host["opt"]) if x.ndim}
    assert kinds == {"pinned_host"}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8_bf16_sr"])  # int8 codes and the rounding bits in one program
def test_update_in_backward_equals_the_plain_update(kind):
    """Each layer updated inside the backward (its codes bitcast through the cotangents): without clipping, the
    plain update's numbers, stochastic rounding bits included."""
    base = ["remat.preset=full", "optimizer.clip_norm=1000"] + KINDS[kind]
    want, s_plain = _steps(base, n=3)
    got, s_bwd = _steps(base + ["optimizer.update_in_backward=true"], n=3)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=1e-6, atol=1e-6), s_bwd["params"], s_plain["params"])


@pytest.mark.slow
def test_stochastic_rounding_keeps_updates_below_half_a_bf16_step():
    """One step whose updates are mostly below half a bf16 step: projected on the exact update (an fp32 master's
    change), the weights rounded stochastically moved by it on average (unbiased), rounded to nearest by far
    less; the same seed and step draw the same bits."""
    small = ["optimizer.lr=1e-5", "optimizer.weight_decay=0"]
    _, start = _steps(BF16_SR + small, n=0)
    _, exact = _steps(["precision.param_dtype=bfloat16", "precision.master_weights=true"] + small, n=1)
    _, nearest = _steps(BF16_SR + small + ["precision.stochastic_rounding=false"], n=1)
    _, sr = _steps(BF16_SR + small, n=1)
    _, again = _steps(BF16_SR + small, n=1)
    w0 = np.asarray(start["params"]["layers"]["w_up"], np.float32)
    delta = np.asarray(exact["master"]["layers"]["w_up"]) - w0

    def moved(state):  # the share of the exact update the stored weights moved by
        return float(np.dot((np.asarray(state["params"]["layers"]["w_up"], np.float32) - w0).ravel(), delta.ravel())
                     / np.dot(delta.ravel(), delta.ravel()))

    assert moved(sr) == pytest.approx(1.0, abs=0.15)
    assert moved(nearest) < 0.5
    jax.tree.map(np.testing.assert_array_equal, again["params"], sr["params"])


def test_lora_adapters_take_int8_moments():
    losses, state = _steps(["lora.rank=32", "lora.targets=all-linear"] + KINDS["int8"], n=3)  # A: 128 x 32
    assert losses[-1] < losses[0]
    assert any(codes.is_quantized(x) for x in jax.tree.leaves(state["opt"], is_leaf=codes.is_quantized))


@pytest.mark.slow
def test_quantized_non_layer_leaves_update_in_pieces_as_whole(monkeypatch):
    """With quantized moments the device updates the embedding and LM head a piece of rows at a time (their
    blocks run along the last dim, so a piece's codes and scales are the whole's rows): the same numbers as
    updating them whole."""
    from jaxmem.optim import layerwise

    kind = KINDS["int8"]  # (with stochastic rounding each piece draws bits of its own)
    whole, s_whole = _steps(kind, n=2)
    monkeypatch.setattr(layerwise, "CHUNK_BYTES", 4096)
    cfg = load_config(None, SMALL + ["parallel.fsdp=1"] + kind)
    axes, count = build_program(cfg, devices=jax.devices()[:1]).layout.rest_pieces  # (split over fsdp: along d)
    assert count >= 4 and axes["embed"] == 0, (axes, count)
    pieces, s_pieces = _steps(kind, n=2)
    assert pieces == whole
    jax.tree.map(np.testing.assert_array_equal, s_pieces["params"], s_whole["params"])
    jax.tree.map(np.testing.assert_array_equal, s_pieces["opt"], s_whole["opt"])
