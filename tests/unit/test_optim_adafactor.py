"""Adafactor (jaxmem.optim.adafactor) is optax.adafactor on the run's schedule with AdamW-style decoupled
decay; its factored state takes the param's spec without the reduced dim (jaxmem.optim.specs), and
specs.state_specs gives optax's AdamW state the same specs as optax's own tree_map_params (what the program
used before it)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxmem.loader import load_config
from jaxmem.optim import choice, hyper, layerwise
from jaxmem.optim import adafactor, specs

CFG = ["optimizer.warmup_steps=2", "optimizer.weight_decay=0.1", "optimizer.lr=1e-2"]
SHAPES = {"w": (256, 512), "stack": (2, 192, 128), "attn_norm": (512,)}
SPECS = {"w": P("fsdp", None), "stack": P(None, None, "fsdp"), "attn_norm": P()}


def _tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def test_is_optax_adafactor():
    """Three steps equal optax.adafactor's with the LR schedule, no parameter scaling, and weight decay
    lr(t) * weight_decay on all but the norms; the factored state is a row and a column per matrix."""
    cfg = load_config("configs/tiny.yaml", CFG)
    lr = hyper.schedule(cfg)
    mask = {"w": True, "stack": True, "attn_norm": False}
    reference = optax.adafactor(lr, multiply_by_parameter_scale=False, weight_decay_rate=lambda t: lr(t) * 0.1,
                                weight_decay_mask=mask)
    opt = adafactor.make_adafactor(cfg)
    params = _tree(0)
    s_got, s_want = opt.init(params), reference.init(params)
    for seed in (1, 2, 3):
        grads = _tree(seed, 1e-2)
        u_got, s_got = opt.update(grads, s_got, params)
        u_want, s_want = reference.update(grads, s_want, params)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-12), u_got, u_want)
    factored = s_got[0]
    assert factored.v_row["w"].shape == (256,) and factored.v_col["w"].shape == (512,)
    assert factored.v["w"].shape == (1,) and factored.v["attn_norm"].shape == (512,)


def test_factored_state_specs():
    """v_row / v_col keep the param's spec without their reduced dim (the fsdp=8 step sharded so:
    tests/integration/test_optim_sharded.py)."""
    opt = adafactor.make_adafactor(load_config("configs/tiny.yaml", CFG))
    params = _tree(0)
    abstract = jax.eval_shape(opt.init, params)
    state_specs = specs.state_specs(abstract, params, SPECS, {"fsdp": 8})
    factored = state_specs[0]
    assert factored.v_row["w"] == P("fsdp") and factored.v_col["w"] == P(None)
    assert factored.v_row["stack"] == P(None, "fsdp") and factored.v_col["stack"] == P(None, None)
    assert factored.v["w"] == P() and factored.v["attn_norm"] == P(None)


def _tree_map_params_specs(opt, abstract_opt, weight_specs):
    """The layer-wise state's specs by optax.tree_utils.tree_map_params: param-shaped leaves follow the weights'."""
    def specs_of(state, tree):
        return optax.tree_utils.tree_map_params(opt, lambda _, spec: spec, state, tree,
                                                transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))

    rest = {k: v for k, v in weight_specs.items() if k != "layers"}
    return {"rest": specs_of(abstract_opt["rest"], rest), "layers": specs_of(abstract_opt["layers"],
                                                                             weight_specs["layers"])}


def test_adamw_specs_as_optax():
    """For optax's AdamW layer-wise state, state_specs gives what optax's tree_map_params gives."""
    opt = choice.make_optimizer(load_config("configs/tiny.yaml", []))
    weights = {"embed": jax.ShapeDtypeStruct((512, 64), jnp.float32),
               "layers": {"w": jax.ShapeDtypeStruct((2, 64, 256), jnp.float32),
                          "attn_norm": jax.ShapeDtypeStruct((2, 64), jnp.float32)}}
    weight_specs = {"embed": P("fsdp", None), "layers": {"w": P(None, "fsdp", None), "attn_norm": P()}}
    abstract = jax.eval_shape(lambda w: layerwise.init_opt_state(opt, w), weights)
    want = _tree_map_params_specs(opt, abstract, weight_specs)
    got = specs.layerwise_state_specs(abstract, weights, weight_specs, {"fsdp": 8})
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    flat = lambda t: [tuple(s) + (None,) * 4 for s in jax.tree.leaves(t, is_leaf=is_spec)]  # noqa: E731
    assert jax.tree.structure(got, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        want, is_leaf=lambda x: isinstance(x, P))
    assert [s[:4] for s in flat(got)] == [s[:4] for s in flat(want)]
