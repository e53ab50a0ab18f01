"""The optimizers' update jitted on an fsdp=8 mesh of 8 CPU devices, params and state sharded by
`jaxmem.optim.specs.state_specs`, equals the one-device update: int8 / int4 / float8 AdamW moments (codes
sharded like the param, scales too where whole blocks fall inside a shard) and Adafactor's factored second
moment."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxmem.loader import load_config
from jaxmem.optim import adafactor, adamw_lowbit, specs, states

from optim_checks import assert_same_moments


def _tree(seed, shapes, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def _fsdp8():
    assert jax.device_count() == 8, "needs 8 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)"
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    return lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda x: isinstance(x, P))


@pytest.mark.parametrize("kind,block", [("int8", 256), ("int4", 128), ("float8", 256)])
def test_lowbit_adamw_fsdp8_step_equals_one_device(kind, block):
    """Each device holds its shard of the codes, shaped like its shard of the param."""
    bits = states.moment_kind(kind).bits
    shapes = {"rows": (64, 4096), "wo": (4, 8, 512), "stack": (2, 16, 300), "norm": (64,)}
    param_specs = {"rows": P("fsdp", None), "wo": P(None, None, "fsdp"), "stack": P(None, "fsdp", None),
                   "norm": P()}
    opt = adamw_lowbit.scale_by_adam_lowbit(moments=kind, block=block)
    params = _tree(0, shapes)
    state = opt.init(params)
    _, state = jax.jit(opt.update)(_tree(1, shapes, 1e-2), state)
    grads = _tree(2, shapes, 1e-2)
    want_u, want_s = jax.jit(opt.update)(*jax.device_put((grads, state), jax.devices()[0]))

    named = _fsdp8()
    state_specs = specs.state_specs(jax.eval_shape(lambda: state), params, param_specs, {"fsdp": 8})
    step = jax.jit(opt.update, out_shardings=(named(param_specs), named(state_specs)))
    got_u, got_s = step(jax.device_put(grads, named(param_specs)), jax.device_put(state, named(state_specs)))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got_u, want_u)
    assert_same_moments(got_s, want_s)
    wo = got_s.mu["wo"]
    assert wo.codes.sharding.spec == P(None, None, "fsdp") and wo.scales.sharding.spec == P(None, None, None)
    assert wo.codes.addressable_shards[0].data.shape == (4, 8, 512 * bits // 8 // 8)
    rows = got_s.nu["rows"]
    assert rows.scales.sharding.spec == P("fsdp", None) and rows.codes.addressable_shards[0].data.shape == (
        8, 4096 * bits // 8)


def test_adafactor_fsdp8_step_equals_one_device():
    """v_row / v_col sharded by the param's spec without their reduced dim."""
    shapes = {"w": (256, 512), "stack": (2, 192, 128), "attn_norm": (512,)}
    param_specs = {"w": P("fsdp", None), "stack": P(None, None, "fsdp"), "attn_norm": P()}
    opt = adafactor.make_adafactor(load_config("configs/tiny.yaml", [
        "optimizer.warmup_steps=2", "optimizer.weight_decay=0.1", "optimizer.lr=1e-2"]))
    params, grads = _tree(0, shapes), _tree(1, shapes, 1e-2)
    state = opt.init(params)
    state_specs = specs.state_specs(jax.eval_shape(opt.init, params), params, param_specs, {"fsdp": 8})
    want_u, _ = jax.jit(opt.update)(*jax.device_put((grads, state, params), jax.devices()[0]))

    named = _fsdp8()
    step = jax.jit(opt.update, out_shardings=(named(param_specs), named(state_specs)))
    got_u, got_s = step(*(jax.device_put(t, named(s)) for t, s in ((grads, param_specs), (state, state_specs),
                                                                  (params, param_specs))))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got_u, want_u)
    assert got_s[0].v_row["stack"].sharding.spec == P(None, "fsdp")
