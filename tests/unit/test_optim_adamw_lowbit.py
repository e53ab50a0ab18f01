"""Low-bit AdamW (jaxmem.optim.adamw_lowbit) against optax's fp32 Adam: a step from the same moments gives
the same update, and stores new moments within the code's bound; the chain is optax.adamw's; the state's
dtypes, shapes and bytes per parameter; the layer-wise update over a stacked state (the fsdp=8 step:
tests/integration/test_optim_sharded.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem.loader import load_config
from jaxmem.optim import choice, layerwise
from jaxmem.optim import adamw_lowbit, codes, states

SHAPES = {"big": (8, 4096), "odd": (9, 41, 341), "norm": (64,)}


def _tree(seed, scale=1.0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    out = jax.tree.map(lambda s: scale * rng.standard_normal(s).astype(np.float32), shapes,
                       is_leaf=lambda x: isinstance(x, tuple))
    if "odd" in out:
        out["odd"][0, 0, :5] *= 1e3  # outliers in a block
    return jax.tree.map(jnp.asarray, out)


def _block_scales(x, block):
    """|largest magnitude| of each element's block along the last dim, per element (numpy)."""
    length, count = codes.block_for(x.shape[-1], block)
    padded = np.zeros(x.shape[:-1] + (count * length,))
    padded[..., :x.shape[-1]] = np.abs(x)
    return np.repeat(padded.reshape(x.shape[:-1] + (count, length)).max(-1), length, -1)[..., :x.shape[-1]]


def _adam_state(opt_state):
    return opt_state[0] if isinstance(opt_state, tuple) else opt_state


@pytest.mark.parametrize("kind", ["int8", "int4", "float8"])
def test_step_matches_fp32_adam(kind):
    """Two low-bit steps build a non-trivial state; from its moments, fp32 optax.scale_by_adam and the low-bit
    step give the same update (the update is taken before requantizing), and the stored new moments are
    optax's within the code's bound (fp32 leaves under the threshold: equal)."""
    lowbit = adamw_lowbit.scale_by_adam_lowbit(b1=0.9, b2=0.95, moments=kind)
    reference = optax.scale_by_adam(b1=0.9, b2=0.95)
    step = jax.jit(lowbit.update)
    state = lowbit.init(_tree(0))
    for seed in (1, 2):
        _, state = step(_tree(seed, 1e-3), state)
    assert codes.is_quantized(state.mu["big"]) and not codes.is_quantized(state.mu["norm"])
    fp32 = optax.ScaleByAdamState(state.count, adamw_lowbit.values(state.mu), adamw_lowbit.values(state.nu))
    grads = _tree(3, 1e-3)
    got, new = step(grads, state)
    want, want_state = jax.jit(reference.update)(grads, fp32)
    # updates are O(1); m's new value may cancel, so XLA's choice of fused multiply-adds shows at 1e-8
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    assert int(new.count) == int(want_state.count) == 3
    for stored, exact, moment in ((new.mu, want_state.mu, "mu"), (new.nu, want_state.nu, "nu")):
        for key, leaf in stored.items():
            value, ref = np.asarray(adamw_lowbit.values(leaf)), np.asarray(exact[key])
            if not codes.is_quantized(leaf):
                np.testing.assert_array_equal(value, ref)
                continue
            bound = codes.CODES[leaf.code].max_error * _block_scales(ref, leaf.block)
            assert np.all(np.abs(value - ref) <= bound * (1 + 1e-5) + 1e-30), (moment, key)


@pytest.mark.slow
@pytest.mark.parametrize("kind,drift,excess", [("int8", 0.05, 0.01), ("int4", 0.4, 0.05), ("float8", 0.05, 0.01)])
def test_trajectory_follows_fp32(kind, drift, excess):
    """50 noisy steps towards a target: the low-bit weights stay near fp32 AdamW's (8 bits, int8 or float8:
    within a few % of the distance travelled; 4 bits drift further) and end about as close to the target."""
    rng = np.random.default_rng(0)
    target = jnp.asarray(rng.standard_normal((64, 4096)), jnp.float32)

    def run(adam):
        tx = optax.chain(adam, optax.scale_by_learning_rate(1e-2))
        w, s = jnp.zeros_like(target), tx.init(target)

        @jax.jit
        def step(w, s, key):
            u, s = tx.update(w - target + 0.5 * jax.random.normal(key, w.shape), s, w)
            return w + u, s

        for i in range(50):
            w, s = step(w, s, jax.random.key(i))
        return w

    want = run(optax.scale_by_adam(0.9, 0.95))
    got = run(adamw_lowbit.scale_by_adam_lowbit(0.9, 0.95, moments=kind))
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= drift
    assert float(jnp.linalg.norm(got - target)) <= (1 + excess) * float(jnp.linalg.norm(want - target))


@pytest.mark.parametrize("kind,per_param,stored", [("int8", 2 + 8 / 2048, jnp.uint8), ("int4", 1 + 8 / 128, jnp.uint8),
                                                  ("float8", 2 + 8 / 256, jnp.float8_e4m3fn)])
def test_state_bytes(kind, per_param, stored):
    """m + v take 2 bytes per parameter in 8 bits (int8 codes or float8 values), 1 in 4, plus an fp32 scale per
    block each; tensors under the threshold keep fp32 moments."""
    bits = states.moment_kind(kind).bits
    opt = adamw_lowbit.make_lowbit_adamw(load_config("configs/tiny.yaml", []), kind)
    params = {"w": jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16), "norm": jax.ShapeDtypeStruct((4095,), jnp.bfloat16)}
    adam = _adam_state(jax.eval_shape(opt.init, params))
    w_m, w_v = adam.mu["w"], adam.nu["w"]
    assert w_m.codes.dtype == w_v.codes.dtype == stored and w_m.scales.dtype == jnp.float32
    block = states.moment_kind(kind).default_block
    assert w_m.codes.shape == (256, 4096 * bits // 8) and w_m.scales.shape == (256, 4096 // block)
    assert (w_m.code, w_v.code) == states.moment_kind(kind).codes
    assert (w_m.nbytes + w_v.nbytes) / (256 * 4096) == pytest.approx(per_param)
    assert adam.mu["norm"].dtype == adam.nu["norm"].dtype == jnp.float32 and adam.mu["norm"].shape == (4095,)


def test_chain_is_adamw():
    """make_lowbit_adamw with every tensor under the threshold is make_optimizer's AdamW (schedule, weight
    decay without norms): the same updates and the same state layout."""
    cfg = load_config("configs/tiny.yaml", ["optimizer.warmup_steps=2", "optimizer.weight_decay=0.1"])
    lowbit = adamw_lowbit.make_lowbit_adamw(cfg, "int8", threshold=10 ** 9)
    reference = choice.make_optimizer(cfg)
    params = _tree(0)
    s_low, s_ref = lowbit.init(params), reference.init(params)
    assert jax.tree.structure(s_low) == jax.tree.structure(s_ref)
    for seed in (1, 2, 3):
        grads = _tree(seed, 1e-2)
        u_low, s_low = lowbit.update(grads, s_low, params)
        u_ref, s_ref = reference.update(grads, s_ref, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12), u_low, u_ref)
    assert np.any(np.asarray(u_low["big"]) != 0)


def test_layerwise_update_slices_layers():
    """jaxmem.optim.layerwise.layerwise_update runs the low-bit optimizer unchanged: the state of a [L, ...] stack
    (init vmapped over the layers) is updated a layer at a time (take_layer / put_layer slice codes and
    scales alike), and equals updating the whole stack at once."""
    opt = adamw_lowbit.make_lowbit_adamw(load_config("configs/tiny.yaml", ["optimizer.warmup_steps=0"]), "int8")
    shapes = {"embed": (16, 4096), "layers": {"w": (3, 8, 1024), "norm": (3, 64)}}
    weights = _tree(0, shapes=shapes)
    state = layerwise.init_opt_state(opt, weights)
    grads = _tree(1, 1e-2, shapes)
    update = jax.jit(lambda g, s, w: layerwise.layerwise_update(
        opt, g, s, w, None, jnp.float32(1.0), clip_norm=0.0, param_dtype=jnp.bfloat16, skip_nonfinite=False))
    _, new_state, new_w, _ = update(grads, state, weights)
    assert codes.is_quantized(_adam_state(new_state["layers"]).mu["w"])
    u, s = jax.jit(jax.vmap(opt.update))(grads["layers"], state["layers"], weights["layers"])
    jax.tree.map(np.testing.assert_array_equal, new_state["layers"], s)
    np.testing.assert_allclose(new_w["layers"]["w"], weights["layers"]["w"] + u["w"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["int4", "float8"])
def test_orbax_round_trip(tmp_path, kind):
    """A low-bit state saves and restores with orbax as the train state is (StandardSave / StandardRestore
    onto an abstract target with shardings), QTensors' meta coming from the target."""
    import orbax.checkpoint as ocp

    opt = adamw_lowbit.scale_by_adam_lowbit(moments=kind)
    params = _tree(0, shapes={"w": (8, 300), "norm": (64,)})
    _, state = jax.jit(opt.update)(_tree(1, shapes={"w": (8, 300), "norm": (64,)}), opt.init(params))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
        ckpt.wait_until_finished()
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        restored = ckpt.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
