"""optimizer.update_in_backward against the plain step (layer-wise update after the backward), with the
optimizer state on the device or in pinned host memory (streamed through the device a layer at a time)."""
import functools
import math
import shutil

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.train import run

TINY = "configs/tiny.yaml"
BASE = ["remat.preset=full", "train.micro_batch=1", "optimizer.warmup_steps=0", "precision.param_dtype=bfloat16",
        "precision.master_weights=true"]
NO_CLIP = ["optimizer.clip_norm=1000"]  # far above the tiny model's gradient norms (~1.4)
HOST_OPT = ["offload.optimizer=host", "offload.optimizer_update=device"]
LAYOUTS = {"one_device": ["parallel.fsdp=1", "train.micro_batch=8"], "fsdp8": ["parallel.fsdp=8"]}


def _steps(overrides, devices, n=3):
    """(loss, grad norm) of n steps and the final state (live arrays, in their memory kinds)."""
    cfg = load_config(TINY, BASE + overrides)
    prog = build_program(cfg, devices=devices)
    state, step = prog.init_state(), prog.jit_step()
    metrics = []
    for i in range(n):
        tokens = np.random.default_rng(i).integers(0, 256, size=(8, cfg.train.seq_len + 1)).astype(np.int32)
        state, m = step(state, prog.shard_batch(tokens.reshape(prog.batch_shape)))
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return metrics, state


@functools.cache
def _plain(layout: str):
    """The plain update (state on the device), shared by the in-backward variants of a layout."""
    return _steps(NO_CLIP + LAYOUTS[layout], _devices(layout))


@functools.cache
def _in_backward(layout: str):
    """The in-backward update without clipping, state on the device: compared with the plain update, and the
    unclipped run the clipping test compares with."""
    return _steps(NO_CLIP + LAYOUTS[layout] + ["optimizer.update_in_backward=true"], _devices(layout))


def _devices(layout: str):
    return jax.devices()[:1] if layout == "one_device" else jax.devices()


def _kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if x.ndim}


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# How far the in-backward update may sit from the plain one after 3 steps (bf16 params, fp32 master). The two
# run the same AdamW formula in another fusion order, so the fp32 master can differ in its last bits; a bf16
# param whose master sits at a rounding tie then flips one bf16 ulp, and the next steps carry that on. jax
# 0.10.2 gives the same bits; jax 0.12.0.1 flipped 217 of 803,968 params by one ulp (2.4e-4 at |w| ~ 0.03)
# and moved the master 2.1e-5 (fsdp 8). One step's update is ~lr = 3e-3 an element: a wrong update (a
# stale gradient, a missed bias correction, another clip) moves them by that much.
MASTER_TOL, PARAMS_TOL, OPT_TOL = 1e-4, 5e-4, 1e-6


def _assert_same_update(inside, plain, inside_state, plain_state):
    np.testing.assert_allclose([m[0] for m in inside], [m[0] for m in plain], rtol=1e-6)
    np.testing.assert_allclose([m[1] for m in inside], [m[1] for m in plain], rtol=1e-5)
    for key, tol in (("params", PARAMS_TOL), ("master", MASTER_TOL), ("opt", OPT_TOL)):
        assert _max_diff(inside_state[key], plain_state[key]) < tol, key


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["device", "host"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_the_plain_update(layout, optimizer):
    """Same losses, gradient norms, master weights, moments and params after 3 steps (no clipping). With
    offload.optimizer=host the master weights and moments stay in pinned host memory between steps (each
    layer's slice is streamed through the device inside the backward)."""
    plain, plain_state = _plain(layout)
    if optimizer == "host":
        inside, inside_state = _steps(NO_CLIP + LAYOUTS[layout] + HOST_OPT + ["optimizer.update_in_backward=true"],
                                      _devices(layout))
    else:
        inside, inside_state = _in_backward(layout)
    _assert_same_update(inside, plain, inside_state, plain_state)
    assert float(inside_state["grad_norm"]) == pytest.approx(inside[-1][1], rel=1e-6)
    state_kind = "pinned_host" if optimizer == "host" else "device"
    assert _kinds((inside_state["opt"], inside_state["master"])) == {state_kind}
    assert _kinds(inside_state["params"]) == {"device"}


def test_layer_inputs_in_host_memory_match_the_plain_update():
    """remat.preset=offload_layer_inputs: the backward fetches each layer's input from pinned host memory;
    the numbers are those of the plain update (fsdp=8, optimizer state on the host too)."""
    plain, plain_state = _plain("fsdp8")
    inside, inside_state = _steps(NO_CLIP + LAYOUTS["fsdp8"] + HOST_OPT + [
        "optimizer.update_in_backward=true", "remat.preset=offload_layer_inputs"], _devices("fsdp8"))
    _assert_same_update(inside, plain, inside_state, plain_state)


def test_clips_by_the_previous_steps_norm():
    """Step 1 has no previous norm: unclipped, like a run that never clips (step 2's loss, computed from the
    params after step 1, is the same). Step 1's norm is above clip_norm, so step 2's gradients are scaled by
    clip_norm / norm: its update differs (and so does everything after it). The unclipped run is the 3-step
    one test_matches_the_plain_update compares."""
    clipped, state_clipped = _steps(LAYOUTS["one_device"] + ["optimizer.update_in_backward=true",
                                                            "optimizer.clip_norm=0.5"], _devices("one_device"))
    free, state_free = _in_backward("one_device")
    assert clipped[:2] == free[:2] and clipped[0][1] > 0.5
    assert clipped[2][0] != free[2][0]  # step 3's loss sees step 2's clipped update
    assert float(state_clipped["grad_norm"]) == clipped[2][1]
    assert _max_diff(state_clipped["opt"], state_free["opt"]) > 0


@pytest.mark.parametrize("override, message", [
    ("remat.preset=selective", "needs remat.preset=full or offload_layer_inputs"),
    ("offload.optimizer=host", "with offload.optimizer=host needs offload.optimizer_update=device"),
    ("offload.params=host", "needs offload.params=device"),
    ("train.grad_accum=2", "needs train.grad_accum=1"),
    ("precision.loss_scale.enabled=true", "cannot skip a step .* turn off precision.loss_scale"),
])
def test_refuses_levers_it_cannot_honour(override, message):
    overrides = BASE + ["optimizer.update_in_backward=true", "parallel.fsdp=1", override]  # a fixed mesh: checked at load
    if "loss_scale" in override:
        overrides += ["precision.compute_dtype=float16", "precision.param_dtype=float16"]
    with pytest.raises(ConfigError, match=f"optimizer.update_in_backward: {message}"):
        load_config(TINY, overrides)


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    """The previous step's norm is train state: a resumed run clips like the uninterrupted one (and restores
    a host-resident optimizer state into pinned host memory). With the state on the device the norm is the
    same train state, saved and restored as in every other resumed run (test_checkpoint.py, test_train.py)."""
    cfg = load_config(TINY, BASE + HOST_OPT + ["optimizer.update_in_backward=true", "optimizer.clip_norm=0.5",
                                              f"out_dir={tmp_path}", "train.progress=false", "train.steps=4",
                                              "train.log_every=1", "checkpoint.every=2", "train.seq_len=32"])
    straight = run(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    resumed = run(cfg)
    assert resumed["resumed_from"] == 2
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"][2:]]
    assert [r["grad_norm"] for r in resumed["records"]] == [r["grad_norm"] for r in straight["records"][2:]]


SMALL = ["model.preset=tiny", "model.d_model=512", "model.d_ff=1536", "model.n_heads=8", "model.n_kv_heads=4",
         "model.head_dim=64", "model.vocab_size=1024", "model.n_layers=4", "train.seq_len=256",
         "train.micro_batch=1", "parallel.fsdp=1", "precision.param_dtype=bfloat16",
         "precision.compute_dtype=bfloat16", "precision.master_weights=true", "remat.preset=full",
         "optimizer.update_in_backward=true", "target.name=h100-80g"]


@pytest.mark.slow
def test_deviceless_host_optimizer_leaves_the_device():
    """Compiled deviceless for one H100: with the state on the host, exactly master + m + v are host
    arguments, and the device total drops by most of them (one layer's leaves are streamed through the
    device in the backward). The analytic bill follows both compiles within 5%."""
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime import aot
    from jaxmem.runtime.compiled_memory import memory_figures

    figures = {}
    for name, extra in (("device", []), ("host", HOST_OPT)):
        cfg = load_config(None, SMALL + extra)
        prog = build_program(cfg, devices=aot.target_devices("h100-80g", 1))
        figures[name] = memory_figures(prog.lower().compile())
        _assert_billed(cfg, figures[name]["device"], streamed=name == "host")
    state = prog.abstract_state
    moved = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((state["opt"], state["master"]))
                if x.ndim)
    device, host = figures["device"], figures["host"]
    assert device["host"] == 0 and host["host_argument"] == moved
    assert host["device"] < device["device"] - moved / 2, (device, host, moved)
    # and the layer inputs (the backward's only residuals) in pinned host memory: [L, rows, T, D] bf16
    cfg = load_config(None, SMALL + HOST_OPT + ["remat.preset=offload_layer_inputs"])
    inputs = cfg.model.n_layers * cfg.train.seq_len * cfg.model.d_model * 2
    lean = memory_figures(build_program(cfg, devices=aot.target_devices("h100-80g", 1)).lower().compile())
    assert lean["host_temp"] >= inputs and lean["device"] <= host["device"] - inputs // 2, (host, lean, inputs)
    _assert_billed(cfg, lean["device"], streamed=True)


def _assert_billed(cfg, compiled: int, streamed: bool):
    """The bill within 5% of the compiled device total. With the barrier before each new weight's cast (jax
    0.12 on) XLA no longer prefetches the next leaf's streamed master, m and v (d_model x d_ff fp32 each, 9.4 MB
    here) that the bill counts (bill.in_backward_stream_bytes): there over by up to that more, never under."""
    from jaxmem.optim.layerwise import _BARRIER_BEFORE_CAST
    from jaxmem.plan.bill import compute_bill

    billed = compute_bill(cfg, 1).device_total
    slack = 3 * 4 * cfg.model.d_model * cfg.model.d_ff if _BARRIER_BEFORE_CAST and streamed else 0
    assert billed == pytest.approx(compiled, rel=0.05) or compiled < billed <= compiled * 1.05 + slack, \
        (billed, compiled)


MOE = ["optimizer.clip_norm=1000", "model.router_aux_loss_coef=0.1", "model.router_z_loss_coef=0.01"]


@pytest.mark.slow
def test_mixture_of_experts_matches_the_plain_update():
    """tiny-moe on fsdp=8 with the optimizer state on the host: the scan carries (h, router statistics) through
    the custom VJP; the router losses (weighted 0.1 and 0.01, so they move the router) and the params after 3
    steps equal the plain step's. The carry is the same on one device; the update with the state on the device
    is test_matches_the_plain_update's (one device and fsdp=8)."""
    layout, extra = "fsdp8", HOST_OPT
    def steps(overrides):
        cfg = load_config("configs/tiny-moe.yaml", BASE + MOE + LAYOUTS[layout] + overrides)
        prog = build_program(cfg, devices=_devices(layout))
        state, step = prog.init_state(), prog.jit_step()
        out = []
        for i in range(3):
            tokens = np.random.default_rng(i).integers(0, 256, size=(8, cfg.train.seq_len + 1)).astype(np.int32)
            state, m = step(state, prog.shard_batch(tokens.reshape(prog.batch_shape)))
            out.append([float(m[k]) for k in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss")])
        return np.array(out), jax.device_get(state["master"])

    plain, plain_master = steps([])
    inside, inside_master = steps(["optimizer.update_in_backward=true", *extra])
    np.testing.assert_allclose(inside, plain, rtol=1e-4)
    assert plain[0, 2] > 2.0 and plain[0, 3] > 0  # the router losses are in the loss (balanced aux: k = 2)
    assert _max_diff(inside_master, plain_master) < MASTER_TOL
    router_moved = np.abs(np.asarray(inside_master["layers"]["router"])).sum()
    assert router_moved > 0
