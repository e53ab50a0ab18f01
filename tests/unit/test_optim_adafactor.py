"""Adafactor (jaxmem.optim.adafactor) is optax.adafactor on the run's schedule with AdamW-style decoupled
decay; its factored state takes the param's spec without the reduced dim (jaxmem.optim.specs), and
specs.state_specs gives optax's AdamW state the same specs as optax's own tree_map_params (what the program
used before it)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmem.loader import load_config
from jaxmem.optim import choice, hyper, layerwise
from jaxmem.model.transformer import abstract_model
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


# Attention weights as the model stores them per layer (jaxmem.model.layers), with a head_dim under optax's
# 128-long minimum for a factored dim, and a LoRA adapter of one of them.
HEADS = {"wq": (192, 4, 64), "wo": (4, 64, 192), "w_up": (192, 256), "attn_norm": (192,),
         "wk": {"a": (192, 8), "b": (8, 2, 64)}}
AS_MATRICES = {"wq": (192, 256), "wo": (256, 192), "w_up": (192, 256), "attn_norm": (192,),
               "wk": {"a": (192, 8), "b": (8, 128)}}


def _heads_tree(seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(scale * rng.standard_normal(s), jnp.float32), HEADS,
                        is_leaf=lambda x: isinstance(x, tuple))


def test_heads_factored_as_their_matrix():
    """A [d, heads, head_dim] weight's second moment is the factored statistics of its [d, heads * head_dim]
    matrix (optax.adafactor on the reshaped tree, step for step), not a full fp32 copy."""
    cfg = load_config("configs/tiny.yaml", CFG)
    lr = hyper.schedule(cfg)
    reference = optax.adafactor(lr, multiply_by_parameter_scale=False, weight_decay_rate=lambda t: lr(t) * 0.1,
                                weight_decay_mask=hyper.decay_mask)
    reshaped = lambda tree: jax.tree.map(lambda x, s: x.reshape(s), tree, AS_MATRICES,  # noqa: E731
                                         is_leaf=lambda x: isinstance(x, tuple))
    opt = adafactor.make_adafactor(cfg)
    params = _heads_tree(0)
    s_got, s_want = opt.init(params), reference.init(reshaped(params))
    for seed in (1, 2, 3):
        grads = _heads_tree(seed, 1e-2)
        u_got, s_got = opt.update(grads, s_got, params)
        u_want, s_want = reference.update(reshaped(grads), s_want, reshaped(params))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a.reshape(b.shape), b, rtol=1e-6, atol=1e-12),
                     u_got, u_want)
        assert jax.tree.map(jnp.shape, u_got) == jax.tree.map(jnp.shape, grads)
    factored = s_got[0]
    assert factored.v_row["wq"].shape == (192,) and factored.v_col["wq"].shape == (256,)
    assert factored.v_row["wo"].shape == (192,) and factored.v_col["wo"].shape == (256,)  # dim 0 the larger
    assert factored.v["wq"].shape == factored.v["wo"].shape == (1,)
    np.testing.assert_allclose(factored.v_row["wq"], s_want[0].v_row["wq"], rtol=1e-6)


def test_matrix_shape_keeps_stacked_dims():
    """Leading dims (the layer stack, experts) stay batch dims; other weights keep their shape."""
    key = lambda *names: [jax.tree_util.DictKey(n) for n in names]  # noqa: E731
    assert adafactor.matrix_shape(key("layers", "wq"), (16, 2048, 32, 64)) == (16, 2048, 2048)
    assert adafactor.matrix_shape(key("layers", "wo"), (16, 32, 64, 2048)) == (16, 2048, 2048)
    assert adafactor.matrix_shape(key("layers", "wv", "b"), (16, 8, 8, 64)) == (16, 8, 512)
    assert adafactor.matrix_shape(key("layers", "expert_up"), (16, 8, 2048, 768)) == (16, 8, 2048, 768)
    assert adafactor.matrix_shape(key("layers", "bq"), (16, 32, 64)) == (16, 32, 64)


def _docs_adafactor_v() -> float:
    """The v column of docs/optimizers.md's Adafactor row with the fp32 master."""
    for line in open("docs/optimizers.md"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["bf16 + fp32 master", "Adafactor"]:
            return float(cells[5])
    raise AssertionError("docs/optimizers.md has no Adafactor row")


@pytest.mark.parametrize("preset, head_dim", [("llama3.2-1b", 64), ("llama3.2-1b", 128), ("llama3-8b", 128)])
def test_state_bytes_per_param_as_documented(preset, head_dim):
    """Adafactor's state per parameter, counted from the state built abstractly for the model's shapes (the
    layer-wise state, bf16 params), is within 2x of docs/optimizers.md's figure, for head dims 64 and 128."""
    heads = {64: 32, 128: 16} if preset == "llama3.2-1b" else {128: 32}
    cfg = load_config("configs/tiny.yaml", ["optimizer.name=adafactor", f"model.preset={preset}",
                                            f"model.head_dim={head_dim}", f"model.n_heads={heads[head_dim]}",
                                            f"model.n_kv_heads={heads[head_dim] // 4}"])
    params = nnx.to_pure_dict(nnx.split(abstract_model(cfg.model, param_dtype=jnp.bfloat16))[1])
    state = jax.eval_shape(lambda p: layerwise.init_opt_state(adafactor.make_adafactor(cfg), p), params)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)
                      if jnp.issubdtype(x.dtype, jnp.floating))
    documented = _docs_adafactor_v()
    assert documented / 2 <= state_bytes / n_params <= documented * 2, (state_bytes / n_params, documented)
