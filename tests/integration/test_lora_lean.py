"""LoRA as its users expect (issue 27): y = x W + scale * (x A) B with no merged weight in the step, no
gradient for any frozen weight, only the stored form of the base kept for the backward under every remat
preset, every frozen linear stored as lora.base_dtype, and a step's FLOPs about 2/3 of a full fine-tune's
(XLA's cost analysis and the cost model)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.loader import load_config
from jaxmem.lora.adapters import merge, target_weights
from jaxmem.lora.frozen import layer_shapes, unstore
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "lora.rank=4", "lora.alpha=8", "parallel.fsdp=1",
        "train.micro_batch=1"]
WIDE = ["model.d_model=256", "model.d_ff=2048", "model.n_heads=4", "model.head_dim=64",
        "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"]
LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _program(*overrides):
    return build_program(load_config("configs/tiny.yaml", BASE + list(overrides)), devices=jax.devices()[:1])


def _grad_jaxpr(prog):
    st = prog.abstract_state
    toks = jnp.zeros((1, prog.cfg.train.seq_len), jnp.int32)
    return jax.make_jaxpr(jax.grad(lambda p, b: loss_sum_fn(prog)(p, toks, toks, base=b)[0]))(st["params"], st["base"])


def _eqns(jaxpr):
    yield from jaxpr.eqns
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _eqns(sub)


@pytest.mark.parametrize("preset", ["none", "full", "selective"])
def test_no_merged_weight_and_no_weight_gradient_under_any_remat(preset):
    """No matmul in the differentiated step has a frozen weight's shape: neither W + scale A B nor dW."""
    prog = _program(*WIDE, "model.n_layers=2", f"remat.preset={preset}", "lora.base_dtype=nf4")
    weights = target_weights(prog.cfg.model)
    shapes = {w.in_shape + w.out_shape for w in weights.values()}
    shapes |= {(prog.cfg.model.n_layers, *s) for s in shapes}
    dots = [e for e in _eqns(_grad_jaxpr(prog).jaxpr) if e.primitive.name == "dot_general"]
    assert dots  # the matmuls are there
    weight_shaped = [e.outvars[0].aval.shape for e in dots if tuple(e.outvars[0].aval.shape) in shapes]
    assert weight_shaped == [], weight_shaped


def test_the_forward_scan_keeps_no_copy_of_the_stored_base_with_remat_none():
    """remat.preset=none: the layer scan's stacked residuals hold activations and no stored (uint8 codes) or
    dequantized weight; the stored base is forwarded to the backward, not copied."""
    prog = _program(*WIDE, "model.n_layers=4", "remat.preset=none", "lora.base_dtype=nf4")
    weights = {w.in_shape + w.out_shape for w in target_weights(prog.cfg.model).values()}
    scans = [e for e in _grad_jaxpr(prog).jaxpr.eqns if e.primitive.name == "scan"]
    forward = scans[0]
    stacked = [v.aval for v in forward.outvars if v.aval.ndim and v.aval.shape[0] == 4]
    assert stacked  # the residuals are there
    assert not [a for a in stacked if jnp.issubdtype(a.dtype, jnp.integer)], stacked
    assert not [a for a in stacked if tuple(a.shape[1:]) in weights], stacked


def _temp(n_layers, preset):
    prog = _program(*WIDE, f"model.n_layers={n_layers}", f"remat.preset={preset}", "lora.base_dtype=nf4")
    m = prog.cfg.model
    layer_bf16 = 2 * sum(np.prod(s) for s in layer_shapes(prog.cfg, prog.layout.part("lora")).values())
    return prog.lower().compile().memory_analysis().temp_size_in_bytes, layer_bf16, m


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["none", "full"])
def test_more_layers_add_activations_not_weights(preset):
    """Measured on CPU (XLA's buffer assignment): four more nf4 layers add less than 3/4 of a bf16 layer each
    (the merged step kept a bf16 layer per layer and more under remat none) and about what their saved
    activations take."""
    temp4, layer, m = _temp(4, preset)
    temp8, _, _ = _temp(8, preset)
    assert (temp8 - temp4) / 4 < 0.75 * layer, (temp4, temp8, layer)


def test_every_frozen_linear_is_stored_as_base_dtype():
    prog = _program("lora.base_dtype=nf4", "lora.targets=q_proj,v_proj")
    base = prog.abstract_state["base"]
    assert prog.layout.part("lora").targets == ("wq", "wv")
    for name in LINEARS:  # adapted or not: nf4 codes and block scales
        assert isinstance(base["layers"][name], dict) and base["layers"][name]["codes"].dtype == jnp.uint8, name
    assert base["embed"].dtype == jnp.float32  # tables as the parameter dtype unless lora.quantize_embeddings
    assert set(prog.abstract_state["params"]["layers"]) == {"wq", "wv"}


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["bfloat16", "nf4"])
def test_adapter_gradients_equal_a_merged_reference(base_dtype):
    """dA, dB (through every layer's dx) equal autodiff of the plain model with W + scale A B merged by hand."""
    prog = _program("model.n_layers=2", "lora.targets=q_proj,v_proj,down_proj", f"lora.base_dtype={base_dtype}",
                    "remat.preset=none")
    state = prog.init_state()
    keys = iter(jax.random.split(jax.random.key(1), 64))
    adapters = jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                            jax.device_get(state["params"]))
    base = jax.device_get(state["base"])
    toks = np.random.default_rng(0).integers(0, 256, (1, 33)).astype(np.int32)
    setup, shapes = prog.layout.part("lora"), layer_shapes(prog.cfg, prog.layout.part("lora"))
    dequantized = dict(base, layers=dict(base["layers"]))
    for name in setup.frozen:
        dequantized["layers"][name] = jnp.stack([
            unstore(setup, jax.tree.map(lambda x: x[i], base["layers"][name]), shapes[name], jnp.float32)
            for i in range(prog.cfg.model.n_layers)])

    def reference(ad):
        logits = nnx.merge(prog.graphdef, merge(dequantized, ad, setup.scale))(toks[:, :-1])
        return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), toks[:, 1:, None], -1).sum()

    got = jax.jit(jax.grad(lambda ad: loss_sum_fn(prog)(ad, toks[:, :-1], toks[:, 1:], base=base)[0]))(adapters)
    want = jax.grad(reference)(adapters)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6), got, want)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(got))


def _xla_flops(prog) -> float:
    cost = prog.lower().compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def test_a_lora_step_costs_about_two_thirds_of_a_full_fine_tune():
    """XLA's cost analysis of the compiled step (one layer: XLA counts a loop body once) and the cost model
    both put a LoRA step at about 2/3 of a full fine-tune's FLOPs, and agree with each other (within what XLA
    leaves out of the one-layer LoRA step: the first layer's input gradient, which only a frozen embedding
    would read, 2 x 4.2M of the 117M FLOPs with q,v targets)."""
    from jaxmem.plan.bill import compute_bill
    from jaxmem.plan.costmodel import estimate

    common = ["model.n_layers=1", "remat.preset=none", "train.seq_len=64", "train.micro_batch=2"]
    ratios = {}
    for name, extra in (("full", []), ("lora", ["lora.rank=4"]), ("qv", ["lora.rank=4", "lora.targets=q_proj,v_proj"])):
        cfg = load_config("configs/tiny.yaml", [o for o in BASE if not o.startswith("lora.rank")] + common + extra)
        prog = build_program(cfg, devices=jax.devices()[:1])
        bill = compute_bill(cfg, 1, gpu=False, layout=prog.layout)
        ratios[name] = (_xla_flops(prog), estimate(cfg, bill, None, 1, 1, 2).model_flops)
    for name in ("lora", "qv"):
        xla, model = (ratios[name][i] / ratios["full"][i] for i in (0, 1))
        assert 0.6 < xla < 0.75 and 0.6 < model < 0.75, (name, xla, model)
        assert abs(xla - model) < 0.1, (name, xla, model)
    # adapters on fewer projections: fewer FLOPs, in both
    assert ratios["qv"][0] < ratios["lora"][0] and ratios["qv"][1] < ratios["lora"][1]


def test_cost_model_counts_4nt_plus_adapters_for_lora():
    from jaxmem.lora.adapters import adapter_param_count, resolve_targets
    from jaxmem.model.presets import param_count
    from jaxmem.plan.bill import compute_bill
    from jaxmem.plan.costmodel import estimate

    overrides = ["model.preset=llama3-8b", "train.seq_len=512", "train.micro_batch=2", "parallel.fsdp=1"]
    full = load_config("configs/tiny.yaml", overrides)
    lora = load_config("configs/tiny.yaml", overrides + ["lora.rank=32", "lora.targets=q_proj,v_proj"])
    m, tokens = full.model, 1024
    matmul_params = param_count(m) - m.vocab_size * m.d_model
    costs = [estimate(c, compute_bill(c, 1, gpu=False), None, 1, 1, 2).model_flops for c in (full, lora)]
    adapters = adapter_param_count(m, resolve_targets("q_proj,v_proj"), 32)
    assert adapters == 32 * 32 * (2 * 4096 + 4096 + 1024)
    np.testing.assert_allclose(costs[0] - costs[1], 2 * matmul_params * tokens - 6 * adapters * tokens, rtol=1e-9)


def _differentiated(prog, monkeypatch):
    """The dtype of every adapter leaf as the step differentiates it (grad_dtype.step_params), per path."""
    from jaxmem.core import grad_dtype

    seen, inputs = {}, grad_dtype.grad_inputs

    def spy(params, exact, dtype):
        out = inputs(params, exact, dtype)
        seen.update({jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_flatten_with_path(out)[0]})
        return out

    monkeypatch.setattr(grad_dtype, "grad_inputs", spy)
    prog.lower()
    return seen


@pytest.mark.parametrize("tiles", [False, True], ids=["untiled", "seq_tile"])
def test_adapters_are_differentiated_at_their_dtype_unless_tiles_sum_them(tiles, monkeypatch):
    """An adapter is used only through a cast to the compute dtype: its fp32 gradient would be a widened bf16
    value, so the step keeps it (and the adapter) at bf16: no fp32 copy of the adapters. Sequence tiles sum a
    tile's adapter gradients in fp32: there they stay fp32. The planner (planned_dtype) says the same."""
    from jaxmem.core.grad_dtype import planned_dtype

    extra = ["remat.seq_tile=16"] if tiles else []
    prog = _program("lora.targets=all-linear", "precision.param_dtype=bfloat16",
                    "precision.compute_dtype=bfloat16", *extra)
    seen = _differentiated(prog, monkeypatch)
    assert len(seen) == 2 * len(LINEARS)
    want = jnp.float32 if tiles else jnp.bfloat16
    assert set(seen.values()) == {jnp.dtype(want)}
    assert planned_dtype("a", prog.cfg, prog.precision) == planned_dtype("b", prog.cfg, prog.precision) == want


@pytest.mark.slow
def test_a_step_on_bf16_adapters_equals_the_fp32_cast_step(monkeypatch):
    """Same adapters, moments and loss after two steps whether the adapters are differentiated at bf16 (the
    default) or cast to fp32 first (the step before), bit for bit."""
    from jaxmem.core import grad_dtype, offload

    overrides = ("lora.targets=all-linear", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16")

    def run():
        prog = _program(*overrides)
        state, step = prog.init_state(), prog.jit_step()
        tokens = np.random.default_rng(0).integers(0, 256, size=prog.batch_shape).astype(np.int32)
        for _ in range(2):
            state, metrics = step(state, prog.shard_batch(tokens))
        return jax.device_get((state["params"], state["opt"], metrics["loss"]))

    lean = run()
    monkeypatch.setattr(grad_dtype, "step_params", lambda prog, grad_fn, params, *a: offload.cast_for_grad(
        prog.cfg, params, prog.precision.grad_reduce))
    cast = run()
    for x, y in zip(jax.tree.leaves(lean), jax.tree.leaves(cast), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
