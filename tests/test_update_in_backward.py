"""optimizer.update_in_backward against the plain step (layer-wise update after the backward)."""
import shutil

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError, load_config
from jaxmem.program import build_program
from jaxmem.train import run

TINY = "configs/tiny.yaml"
BASE = ["remat.preset=full", "train.micro_batch=1", "optimizer.warmup_steps=0", "precision.param_dtype=bfloat16",
        "precision.master_weights=true"]
NO_CLIP = ["optimizer.clip_norm=1000"]  # far above the tiny model's gradient norms (~1.4)


def _steps(overrides, devices, n=3):
    cfg = load_config(TINY, BASE + overrides)
    prog = build_program(cfg, devices=devices)
    state, step = prog.init_state(), prog.jit_step()
    metrics = []
    for i in range(n):
        tokens = np.random.default_rng(i).integers(0, 256, size=(8, cfg.train.seq_len + 1)).astype(np.int32)
        state, m = step(state, prog.shard_batch(tokens.reshape(prog.batch_shape)))
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return metrics, jax.device_get(state)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.mark.parametrize("layout", [["parallel.fsdp=1", "train.micro_batch=8"], ["parallel.fsdp=8"]],
                         ids=["one_device", "fsdp8"])
def test_matches_the_plain_update(layout):
    """Same losses, gradient norms, master weights, moments and params after 3 steps (no clipping)."""
    devices = jax.devices()[:1] if "parallel.fsdp=1" in layout else jax.devices()
    plain, plain_state = _steps(NO_CLIP + layout, devices)
    inside, inside_state = _steps(NO_CLIP + layout + ["optimizer.update_in_backward=true"], devices)
    np.testing.assert_allclose([m[0] for m in inside], [m[0] for m in plain], rtol=1e-6)
    np.testing.assert_allclose([m[1] for m in inside], [m[1] for m in plain], rtol=1e-5)
    for key in ("params", "master", "opt"):
        assert _max_diff(inside_state[key], plain_state[key]) < 1e-6, key
    assert float(inside_state["grad_norm"]) == pytest.approx(inside[-1][1], rel=1e-6)


def test_clips_by_the_previous_steps_norm():
    """Step 1 has no previous norm: unclipped, like a run that never clips (step 2's loss, computed from the
    params after step 1, is the same). Step 1's norm is above clip_norm, so step 2's gradients are scaled by
    clip_norm / norm: its update differs."""
    devices = jax.devices()[:1]
    layout = ["parallel.fsdp=1", "train.micro_batch=8", "optimizer.update_in_backward=true"]
    clipped, state_clipped = _steps(layout + ["optimizer.clip_norm=0.5"], devices, 2)
    free, state_free = _steps(layout + NO_CLIP, devices, 2)
    assert clipped == free and clipped[0][1] > 0.5
    assert float(state_clipped["grad_norm"]) == clipped[1][1]
    assert _max_diff(state_clipped["opt"], state_free["opt"]) > 0


@pytest.mark.parametrize("override, message", [
    ("remat.preset=selective", "needs remat.preset=full"),
    ("offload.optimizer=host", "needs offload.optimizer=device"),
    ("train.grad_accum=2", "needs train.grad_accum=1"),
    ("precision.loss_scale.enabled=true", "cannot skip a step .* turn off precision.loss_scale"),
])
def test_refuses_levers_it_cannot_honour(override, message):
    overrides = BASE + ["optimizer.update_in_backward=true", "parallel.fsdp=1", override]  # a fixed mesh: checked at load
    if "loss_scale" in override:
        overrides += ["precision.compute_dtype=float16", "precision.param_dtype=float16"]
    with pytest.raises(ConfigError, match=f"optimizer.update_in_backward: {message}"):
        load_config(TINY, overrides)


def test_resume_is_exact(tmp_path):
    """The previous step's norm is train state: a resumed run clips like the uninterrupted one."""
    cfg = load_config(TINY, BASE + ["optimizer.update_in_backward=true", "optimizer.clip_norm=0.5", f"out_dir={tmp_path}",
                                    "train.progress=false", "train.steps=4", "train.log_every=1",
                                    "checkpoint.every=2", "train.seq_len=32"])
    straight = run(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    resumed = run(cfg)
    assert resumed["resumed_from"] == 2
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"][2:]]
    assert [r["grad_norm"] for r in resumed["records"]] == [r["grad_norm"] for r in straight["records"][2:]]
