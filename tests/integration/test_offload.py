"""Host offload of optimizer state and parameters: same numbers as all-device on CPU, bytes on host when
compiled deviceless for an H100."""
import math

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.runtime.compiled_memory import memory_figures
from jaxmem.registry import build_program

TINY = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=16", "train.micro_batch=2", "parallel.fsdp=2",
        "precision.param_dtype=bfloat16", "precision.master_weights=true", "precision.grad_reduce_dtype=bfloat16",
        "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "remat.preset=full"]
VARIANTS = {
    "device": [],
    "optimizer_host_update_host": ["offload.optimizer=host", "offload.optimizer_update=host"],
    "optimizer_host_update_device": ["offload.optimizer=host", "offload.optimizer_update=device"],
    "params_and_optimizer_host": ["offload.optimizer=host", "offload.params=host"],
    "params_host_update_device": ["offload.params=host"],
}


def _train(overrides, steps=2, devices=2):
    prog = build_program(load_config(None, TINY + overrides), devices=jax.devices()[:devices])
    state = prog.init_state()
    tokens = np.random.RandomState(0).randint(0, 256, prog.batch_shape).astype(np.int32)
    step = prog.jit_step()
    losses = []
    for _ in range(steps):
        state, metrics = step(state, prog.shard_batch(tokens))
        losses.append(float(metrics["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def all_device():
    return _train(VARIANTS["device"])


def _kinds(tree):
    return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _assert_same_training(trained, reference):
    (state, losses), (ref_state, ref_losses) = trained, reference
    assert losses[1] < losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for key in ("params", "master", "opt"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                             rtol=1e-6, atol=1e-7), state[key], ref_state[key])


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "device"])
def test_offloaded_training_matches_all_device(name, all_device):
    state, losses = _train(VARIANTS[name])
    _assert_same_training((state, losses), all_device)
    if "offload.optimizer=host" in VARIANTS[name]:
        arrays = [x for x in jax.tree.leaves((state["opt"], state["master"])) if x.ndim]
        assert {x.sharding.memory_kind for x in arrays} == {"pinned_host"}
    if "offload.params=host" in VARIANTS[name]:
        assert _kinds(state["params"]["layers"]) == {"pinned_host"}
        assert _kinds(state["params"]["embed"]) == {"device"}
    else:
        assert _kinds(state["params"]) == {"device"}


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [2, 1], ids=["pieces_along_d", "pieces_along_vocab"])
def test_streamed_update_in_pieces_matches_all_device(fsdp, monkeypatch):
    """Params and optimizer state on the host, the update on the device: the embedding's and LM head's state
    streams through it a piece at a time (as at full size, where one piece is CHUNK_BYTES), with the same
    training as moved whole (which test_offloaded_training_matches_all_device holds to the all-device one).
    Split over fsdp the embedding is cut along d, whole along its vocabulary."""
    from jaxmem.optim import layerwise as optim

    layout = [f"parallel.fsdp={fsdp}"]
    overrides = layout + VARIANTS["params_and_optimizer_host"] + ["offload.optimizer_update=device"]
    reference = _train(overrides, devices=fsdp)  # the tiny leaves moved whole (under CHUNK_BYTES)
    monkeypatch.setattr(optim, "CHUNK_BYTES", 4096)
    axes, count = build_program(load_config(None, TINY + overrides), devices=jax.devices()[:fsdp]).layout.rest_pieces
    assert count >= 4 and axes["embed"] == (1 if fsdp == 2 else 0), (axes, count)
    streamed_whole = build_program(load_config(None, TINY + layout + VARIANTS["optimizer_host_update_device"]),
                                   devices=jax.devices()[:fsdp])
    assert streamed_whole.layout.rest_pieces is None  # layers on the device: moved whole (offload.py)
    _assert_same_training(_train(overrides, devices=fsdp), reference)


def test_bad_offload_combinations_fail_before_compile():
    with pytest.raises(ConfigError, match="offload.params=host: needs a remat preset"):
        build_program(load_config(None, TINY + ["offload.params=host", "remat.preset=none"]),
                      devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match="offload.params=host: needs train.grad_accum=1"):
        build_program(load_config(None, TINY + ["offload.params=host", "train.grad_accum=2"]),
                      devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match="offload.params=host: needs remat.granularity=layer"):
        build_program(load_config(None, TINY + ["offload.params=host", "remat.granularity=segments"]),
                      devices=jax.devices()[:2])
    with pytest.raises(ConfigError, match="offload.optimizer"):
        load_config(None, ["offload.optimizer=disk"])


# ---------------------------------------------------------------- deviceless H100

H100_8B = ["model.preset=llama3-8b", "model.n_layers=2", "train.seq_len=2048", "parallel.fsdp=1",
           "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true",
           "remat.preset=full"]


def _bytes(tree) -> int:
    """Bytes of the arrays in `tree` (scalars, e.g. Adam's count, stay on the device by design)."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)


def _compile(overrides):
    from jaxmem.runtime import aot

    cfg = load_config(None, H100_8B + overrides)
    prog = build_program(cfg, devices=aot.target_devices("h100-80g", 1))
    return prog, memory_figures(prog.lower().compile())


@pytest.mark.slow
def test_deviceless_optimizer_and_params_on_host():
    pytest.importorskip("jax_cuda12_plugin")
    base_prog, base = _compile([])
    opt_prog, opt = _compile(["offload.optimizer=host"])
    moved = _bytes(opt_prog.abstract_state["opt"]) + _bytes(opt_prog.abstract_state["master"])
    assert base["host"] == 0
    assert opt["host_argument"] == moved  # exactly the optimizer state and master weights
    # the device saves about the state moved: within 10% with jax 0.10.2; jax 0.11.2's XLA also moves the
    # update's fp32 temporaries off the device (1.16x the state for this model)
    assert 0.9 * moved <= base["device"] - opt["device"] <= 1.2 * moved, (base, opt, moved)

    par_prog, par = _compile(["offload.optimizer=host", "offload.params=host"])
    layers = _bytes(par_prog.abstract_state["params"]["layers"])
    assert par["host_argument"] == moved + layers
    # the layer weights leave the device, and so do their gradients (bf16, produced per layer). The default
    # step with the weights on the device no longer makes an fp32 copy of the layers nor fp32 projection
    # gradients (jaxmem.core.grad_dtype), which the weights-on-host step never made either, so what is left of the
    # difference is less than the layers' bytes (this 2-layer model: 0.19 of 0.81 GiB)
    assert par["device"] < opt["device"] and par["device"] - par["temp"] <= opt["device"] - opt["temp"] - layers, \
        (opt, par, layers)


def test_deviceless_gpu_host_update_through_the_kernel():
    """kernels.host_update=fused in a GPU program: the kernel, registered with the CUDA plugin for its host
    programs, is compiled into the step's host computation (one call per state tensor, over 8 GPUs on each
    one's FSDP shard) and the step keeps XLA's update's host bytes per device and no more device bytes. auto
    keeps XLA's update on a GPU (the kernel has not run on one yet). One GPU is the same registration and call
    per tensor with unsplit shards; the kernel's one-device step is tests/unit/test_host_adamw.py's
    test_train_step_runs_the_kernel_and_resumes_exactly."""
    gpus = 8
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.kernels.host_adamw import build
    from jaxmem.runtime import aot

    small = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=256", f"parallel.fsdp={gpus}",
             "precision.param_dtype=bfloat16", "precision.master_weights=true", "offload.optimizer=host"]
    figures = {}
    for impl in ("auto", "fused"):
        prog = build_program(load_config(None, small + [f"kernels.host_update={impl}"]),
                             devices=aot.target_devices("h100-80g", gpus))
        assert (prog.fused_update is not None) == (impl == "fused")
        compiled = prog.lower().compile()
        calls = compiled.as_text().count(f'custom_call_target="{build.TARGET}"')
        assert calls == (len(jax.tree.leaves(prog.abstract_state["master"])) if impl == "fused" else 0)
        figures[impl] = memory_figures(compiled)
    assert figures["fused"]["device"] <= figures["auto"]["device"]
    for kind in ("host_argument", "host_output", "host_temp"):  # a shard each: nothing gathered onto one host
        assert figures["fused"][kind] == figures["auto"][kind], kind


@pytest.mark.parametrize("moments", ["float32", "int8", "int4"])
def test_fused_host_update_on_the_fsdp_mesh_follows_xla(moments):
    """kernels.host_update=fused over 8 CPU devices (fsdp=8, the state sharded in pinned host memory): each
    device's shard goes through the kernel (a quantized tensor whose last dim is split finer than a block
    takes the same step in jnp), and 4 steps give XLA's update's losses within 1e-5 and its weights within a
    hundredth of a step (all but a few with quantized moments)."""
    from jaxmem.kernels.host_adamw import build

    small = ["model.preset=tiny", "model.n_layers=2", "train.seq_len=16", "optimizer.warmup_steps=0",
             "optimizer.lr=1e-2", "precision.param_dtype=bfloat16", "precision.master_weights=true",
             "offload.optimizer=host", "parallel.fsdp=8", "train.micro_batch=2", f"precision.moment_dtype={moments}"]
    runs = {}
    for impl in ("xla", "fused"):
        prog = build_program(load_config(None, small + [f"kernels.host_update={impl}"]), devices=jax.devices()[:8])
        state, step, losses = prog.init_state(), prog.jit_step(), []
        for i in range(4):
            tokens = np.random.default_rng(i).integers(0, 256, prog.batch_shape).astype(np.int32)
            state, metrics = step(state, prog.shard_batch(tokens))
            losses.append(float(metrics["loss"]))
        target = build.TARGET if moments == "float32" else build.LOWBIT_TARGET
        calls = step.lower(prog.abstract_state, prog.shard_batch(tokens)).as_text().count(f"@{target}(")
        runs[impl] = losses, state, calls
    assert runs["xla"][2] == 0 and runs["fused"][2] > 0
    np.testing.assert_allclose(runs["fused"][0], runs["xla"][0], rtol=1e-5)
    assert runs["fused"][0][-1] != runs["fused"][0][0]
    # the kernel's last-bit differences flip a few bf16 params, which move later gradients, and with quantized
    # moments carry a few values across a code's midpoint (a code's gap: large in 4 bits). Adam's normalized
    # step moves a weight by up to lr (1e-2) per step: the weights agree to 1% of one step, but for a few
    # (at most 0.01% of them; 0.1% with quantized moments), which stay within the 4 steps' reach
    for a, b in zip(*(jax.tree.leaves(runs[impl][1]["master"]) for impl in ("fused", "xla"))):
        gap = np.abs(np.asarray(a) - np.asarray(b))
        far = np.mean(gap > 1e-4 + 1e-4 * np.abs(np.asarray(b)))
        assert far <= (1e-4 if moments == "float32" else 1e-3), (moments, far)
        assert gap.max() <= 4 * 1e-2


def test_layerwise_update_matches_plain_optax():
    import jax.numpy as jnp
    import optax

    from jaxmem.optim.layerwise import init_opt_state, layerwise_update

    rng = np.random.RandomState(0)
    weights = {"embed": jnp.asarray(rng.randn(6, 4), jnp.float32),
               "layers": {"w": jnp.asarray(rng.randn(3, 4, 5), jnp.float32), "n": jnp.ones((3, 5))}}
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    reference = optax.chain(optax.clip_by_global_norm(0.5), adamw)
    ref_w, ref_s = weights, reference.init(weights)
    w, s = weights, init_opt_state(adamw, weights)
    for step in range(3):
        grads = jax.tree.map(lambda x: jnp.asarray(rng.randn(*x.shape), jnp.float32) * (step + 1), weights)
        updates, ref_s = reference.update(grads, ref_s, ref_w)
        ref_w = optax.apply_updates(ref_w, updates)
        scaled = jax.tree.map(lambda g: g * 8.0, grads)  # loss scale 8, unscaled inside
        p, s, w, (norm, finite) = layerwise_update(adamw, scaled, s, w, None, jnp.float32(8.0), clip_norm=0.5,
                                                   param_dtype=jnp.float32, skip_nonfinite=False)
        np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), w, ref_w)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), p, w)
