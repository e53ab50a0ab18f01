"""Lean residuals by default (issue 27): the gated activation keeps only gate and up for its backward, and
RMSNorm keeps its input in its own dtype (not an fp32 copy). Both equal plain autodiff of their references;
a whole tiny-model step is unchanged; a remat-none step compiles to fewer bytes."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem.model.mlp as mlp
from jaxmem.loader import load_config
from jaxmem.kernels.rms_norm.lean import rms_norm_lean
from jaxmem.kernels.rms_norm.reference import rms_norm_reference
from jaxmem.model.gated import ACTIVATIONS, gated_activation, gated_reference
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

SHAPES = [(3, 7, 48), (37, 129), (2, 5, 3, 17)]  # odd rows, odd widths, a per-head (q/k norm) shape
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # relative to the largest magnitude of the expected value


def _close(got, want, tol, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(float(np.abs(want).max()), 1e-6)
    err = float(np.abs(got - want).max()) / scale
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _inputs(shape, dtype, n, seed):
    keys = jax.random.split(jax.random.key(seed), n)
    return [(2.0 * jax.random.normal(k, shape, jnp.float32)).astype(dtype) for k in keys]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_activation_matches_autodiff_of_the_reference(activation, shape, dtype):
    gate, up, ct = _inputs(shape, dtype, 3, len(shape) + shape[-1])
    y = jax.jit(gated_activation, static_argnums=0)(activation, gate, up)
    assert y.dtype == dtype
    want_y = jax.jit(gated_reference, static_argnums=0)(activation, gate, up)
    _close(y, want_y, TOL[dtype] / 100, "y")  # the same forward (jit may fuse it differently)
    loss = lambda f: lambda g, u: jnp.sum(f(activation, g, u).astype(jnp.float32) * ct.astype(jnp.float32))
    got = jax.jit(jax.grad(loss(gated_activation), (0, 1)))(gate, up)
    # the spec: plain autodiff of the reference in fp32 (bf16 autodiff itself rounds every internal)
    want = jax.grad(loss(gated_reference), (0, 1))(gate.astype(jnp.float32), up.astype(jnp.float32))
    for g, w, name in zip(got, want, ("d_gate", "d_up")):
        assert g.dtype == dtype
        _close(g, w, TOL[dtype], name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_lean_matches_autodiff_of_the_reference(shape, dtype):
    x, ct = _inputs(shape, dtype, 2, shape[-1])
    w = (1.0 + 0.3 * jax.random.normal(jax.random.key(1), shape[-1:], jnp.float32)).astype(dtype)
    y = jax.jit(rms_norm_lean, static_argnums=2)(x, w, 1e-5)
    assert y.dtype == dtype
    _close(y, jax.jit(rms_norm_reference, static_argnums=2)(x, w, 1e-5), TOL[dtype] / 100, "y")
    loss = lambda f: lambda x, w: jnp.sum(f(x, w, 1e-5).astype(jnp.float32) * ct.astype(jnp.float32))
    got = jax.jit(jax.grad(loss(rms_norm_lean), (0, 1)))(x, w)
    want = jax.grad(loss(rms_norm_reference), (0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
    for g, ref, name in zip(got, want, ("dx", "dw")):
        assert g.dtype == dtype
        _close(g, ref, TOL[dtype], name)


def test_rms_norm_lean_rejects_a_mismatched_weight():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_lean(jnp.ones((2, 8)), jnp.ones((4,)))


def _program(config, *overrides):
    cfg = load_config(config, ["train.seq_len=32", "parallel.fsdp=1", "train.micro_batch=2",
                               "remat.preset=none", *overrides])
    return build_program(cfg, devices=jax.devices()[:1])


def _plain(prog, monkeypatch):
    """The same program with plain autodiff: the reference norm and an undecorated gated activation."""
    monkeypatch.setattr(mlp, "gated_activation", gated_reference)
    return dataclasses.replace(prog.ctx, norm=rms_norm_reference)


def _loss_and_grads(prog, ctx, params, tokens):
    fn = lambda p: loss_sum_fn(prog, ctx)(p, tokens, tokens)[0]
    return jax.jit(jax.value_and_grad(fn))(params)


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/tiny-gemma3.yaml"])
def test_a_tiny_step_gives_the_same_loss_and_gradients(config, monkeypatch):
    prog = _program(config)
    params = prog.init_state(0)["params"]
    tokens = jax.random.randint(jax.random.key(3), (2, 32), 0, prog.cfg.model.vocab_size)
    loss, grads = _loss_and_grads(prog, prog.ctx, params, tokens)
    loss_ref, grads_ref = _loss_and_grads(prog, _plain(prog, monkeypatch), params, tokens)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-6)
    flat, flat_ref = jax.tree.leaves_with_path(grads), jax.tree.leaves(grads_ref)
    for (path, g), r in zip(flat, flat_ref):
        _close(g, r, 1e-4, jax.tree_util.keystr(path))


def _stacked_residual_bytes(prog, ctx, params, tokens):
    """Bytes of the per-layer values the forward layer scan stacks for the backward (remat none)."""
    fn = lambda p, t: loss_sum_fn(prog, ctx)(p, t, t)[0]
    jaxpr = jax.make_jaxpr(jax.grad(fn))(params, tokens).jaxpr
    forward = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    n = prog.cfg.model.n_layers
    return sum(v.aval.size * v.aval.dtype.itemsize for v in forward.outvars if v.aval.ndim and v.aval.shape[0] == n)


def _temp_bytes(prog, ctx, params, tokens):
    fn = lambda p, t: loss_sum_fn(prog, ctx)(p, t, t)[0]
    return jax.jit(jax.grad(fn)).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/tiny-gemma3.yaml"])
def test_remat_none_keeps_fewer_residual_bytes(config, monkeypatch):
    """bf16 compute, remat none: per layer the scan stacks no SiLU/GELU internals and no fp32 norm inputs."""
    prog = _program(config, "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16")
    m, rows = prog.cfg.model, 2 * 32
    params = prog.abstract_state["params"]
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    lean = _stacked_residual_bytes(prog, prog.ctx, params, tokens)
    lean_temp = _temp_bytes(prog, prog.ctx, params, tokens)
    plain_ctx = _plain(prog, monkeypatch)
    plain = _stacked_residual_bytes(prog, plain_ctx, params, tokens)
    plain_temp = _temp_bytes(prog, plain_ctx, params, tokens)
    # at least the activation's output and one internal ([rows, d_ff] bf16 each) and the fp32 copies of the
    # two layer norms' inputs ([rows, d_model], 2 bytes more each than bf16) leave every layer
    floor = m.n_layers * rows * (2 * m.d_ff * 2 + 2 * m.d_model * 2)
    print(config, "stacked residuals", plain, "->", lean, "temp", plain_temp, "->", lean_temp)
    assert plain - lean >= floor, (plain, lean, floor)
    assert lean_temp < plain_temp, (lean_temp, plain_temp)


def _stacked_avals(prog, ctx):
    fn = lambda p, t: loss_sum_fn(prog, ctx)(p, t, t)[0]
    tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(fn))(prog.abstract_state["params"], tokens).jaxpr
    forward = next(e for e in jaxpr.eqns if e.primitive.name == "scan")
    n = prog.cfg.model.n_layers
    return sorted((v.aval.shape[1:], str(v.aval.dtype)) for v in forward.outvars if v.aval.ndim and v.aval.shape[0] == n)


@pytest.mark.parametrize("remat", [["remat.preset=full", "remat.names.mlp_act=device"], ["remat.preset=selective"]])
def test_checkpoint_policies_save_the_same_values(remat, monkeypatch):
    """The tag on the product still names it: a policy that saves mlp_act saves it (one [B, T, d_ff] value
    per layer besides the layer input), and the checkpointed presets save what plain autodiff saved."""
    prog = _program("configs/tiny.yaml", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
                    *remat)
    lean = _stacked_avals(prog, prog.ctx)
    assert lean == _stacked_avals(prog, _plain(prog, monkeypatch))
    btf = ((2, 32, prog.cfg.model.d_ff), "bfloat16")
    assert lean.count(btf) == (1 if "remat.names.mlp_act=device" in remat else 2)  # act; or gate and up


@pytest.mark.parametrize("config", ["configs/tiny.yaml", "configs/tiny-gemma3.yaml"])
def test_the_bill_counts_the_residuals_the_scan_stacks(config):
    """remat none: the analytic bill's MLP and norm residuals are the [B, T, d_ff] and [B, T, d_model] values
    the layer scan stacks (gate, up, product; the norms' bf16 inputs and the normed outputs)."""
    from jaxmem.plan.bill import compute_bill

    prog = _program(config, "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16")
    m = prog.cfg.model
    stacked = _stacked_avals(prog, prog.ctx)
    by_name = compute_bill(prog.cfg, 1, gpu=False).activations_by_name
    btd, btf = 2 * 32 * m.d_model * 2 * m.n_layers, 2 * 32 * m.d_ff * 2 * m.n_layers
    assert sum(by_name[n] for n in ("mlp_gate", "mlp_up", "mlp_act")) == \
        stacked.count(((2, 32, m.d_ff), "bfloat16")) * btf
    norms = ("norm_inputs", "attn_norm", "mlp_norm", "post_norm_inputs")
    assert sum(by_name.get(n, 0) for n in norms) == stacked.count(((2, 32, m.d_model), "bfloat16")) * btd
    assert not any("fp32" in n or "silu" in n for n in by_name)
