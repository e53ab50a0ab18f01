"""Gradients held at the narrowest dtype that loses nothing.

The plain step differentiates the loss with respect to the params cast to `precision.grad_reduce_dtype`
(fp32 by default), so every gradient is fp32. But a weight the model only ever uses through a cast to the
compute dtype (every matmul weight: `w.astype(compute)`) gets a gradient that is a bf16 value widened to
fp32: the fp32 buffer carries no more information than a bf16 one. `exact_dtypes` reads the gradient's
jaxpr and finds, per leaf, whether its value is such a widening (through reshapes, layer scans and nested
calls); the step then differentiates those leaves at the params' own dtype. The gradient of every such leaf
is bit-for-bit the one the fp32 step computes (it is the same bf16 value, not widened), the fp32 copy of the
params that the cast made (the whole layer stack) never exists, and the gradient takes half the bytes.
Leaves whose gradient is summed or scattered in fp32 (norm scales, the embedding table, anything
accumulated over micro-batches) keep `grad_reduce_dtype`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jaxmem.core import offload
from jaxmem.model.seq_tiling import tile_count

# Ops that move or relabel a value without changing any element: a widened value stays a widened value.
_PASS_THROUGH = {"reshape", "transpose", "squeeze", "expand_dims", "copy", "copy_p", "sharding_constraint",
                 "mesh_cast", "reduce_precision_noop"}
# Ops that run a nested jaxpr whose outputs are the op's outputs, one to one.
_CALLS = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call", "remat2"}


def _inner(eqn):
    j = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    return getattr(j, "jaxpr", j)


def _producers(jaxpr) -> dict:
    return {id(v): (eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars)}


def _widened_from(var, jaxpr, producers, depth=0):
    """The narrower float dtype `var`'s value was widened from (convert_element_type), else None."""
    if depth > 200 or isinstance(var, jex_core.Literal):
        return None
    found = producers.get(id(var))
    if found is None:  # an input of this jaxpr
        return None
    eqn, index = found
    name = eqn.primitive.name
    if name == "convert_element_type":
        src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
        floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
        if floats and jnp.finfo(src).bits < jnp.finfo(dst).bits:
            return jnp.dtype(src)
        return _widened_from(eqn.invars[0], jaxpr, producers, depth + 1) if src == dst else None
    if name in _PASS_THROUGH:
        return _widened_from(eqn.invars[0], jaxpr, producers, depth + 1)
    if name in _CALLS:
        inner = _inner(eqn)
        if inner is None:
            return None
        return _widened_from(inner.outvars[index], inner, _producers(inner), depth + 1)
    if name == "scan":
        carry = _num_carry(eqn)
        if carry is None:  # a scan this walk cannot read: the leaf keeps the plain step's fp32 cast
            return None
        if index < carry:  # a loop carry mixes iterations: not followed
            return None
        body = eqn.params["jaxpr"].jaxpr
        return _widened_from(body.outvars[index], body, _producers(body), depth + 1)
    return None


def _num_carry(eqn):
    """How many of a scan's outputs are its loop carry (the rest are the stacked per-iteration outputs).
    jax 0.10 names the count (num_carry); jax 0.11 and 0.12 describe the outputs as a flat tree (ft_out =
    (carry, ys)) instead. None for a form this walk does not follow."""
    if "num_carry" in eqn.params:
        return eqn.params["num_carry"]
    ft_out = eqn.params.get("ft_out")
    try:
        return len(ft_out.unpack()[0])
    except (AttributeError, IndexError, TypeError):
        return None


def exact_dtypes(grad_fn, *abstract_args):
    """Per leaf of grad_fn's output (a params-shaped gradient tree): the narrower float dtype its values were
    widened from, else None. Traced abstractly (no compile, no FLOPs)."""
    closed, out_shape = jax.make_jaxpr(grad_fn, return_shape=True)(*abstract_args)
    jaxpr = closed.jaxpr
    producers = _producers(jaxpr)
    found = [_widened_from(v, jaxpr, producers) for v in jaxpr.outvars]
    return jax.tree.unflatten(jax.tree.structure(out_shape), found)


def grad_inputs(params: dict, exact: dict, grad_dtype) -> dict:
    """The params as the step differentiates them: a leaf whose gradient is exact at its own dtype stays as it
    is (no cast, no copy); every other leaf is cast to `grad_dtype`, as the plain step does."""
    def pick(p, narrow):
        keep = narrow is not None and jnp.dtype(narrow) == jnp.dtype(p.dtype)
        return p if keep else p.astype(grad_dtype)

    return jax.tree.map(pick, params, exact, is_leaf=lambda x: x is None)


def step_params(prog, grad_fn, params, micro_batches, denom, base):
    """The params as the train step differentiates them: at grad_reduce_dtype, except the leaves whose
    gradient is a widened param-dtype value anyway: those stay as stored, so neither an fp32 copy of them nor
    an fp32 gradient exists. Same gradient values either way. `grad_fn(params, micro, denom, base, key)` is
    the step's (gradients, loss) function; `micro_batches` [A, ...] as the step splits them."""
    cfg, grad_reduce = prog.cfg, prog.precision.grad_reduce
    cast = offload.cast_for_grad(cfg, params, grad_reduce)
    if cfg.offload.params == "host":
        return cast
    micro = jax.tree.map(lambda x: x[0], micro_batches)
    probe = lambda p, m, d: grad_fn(p, m, d, base, None)[0]  # noqa: E731
    return grad_inputs(params, exact_dtypes(probe, *abstract((cast, micro, denom))), grad_reduce)


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


# The analytic mirror of `exact_dtypes` for the planner (jaxmem.plan.bill), which reads no jaxpr: the weights
# the model uses only through `w.astype(compute)` in a projection (jaxmem.model.layers.einsum_project and the
# LM head), and a LoRA run's adapters (jaxmem.lora.linear: `a.astype(compute)`, `b.astype(compute)`, every
# adapter, experts' too) unless sequence tiles sum their gradient over the tiles in fp32. tests/unit/
# test_lean_update.py checks it against `exact_dtypes` on the model.
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
ADAPTERS = ("a", "b")


def planned_dtype(name: str, cfg, prec, sp: int = 1):
    """The dtype the default step holds leaf `name`'s gradient in (before any micro-batch accumulation); a
    LoRA run's leaves are its adapters' `a` and `b`. `sp`: the resolved sequence-parallel axis (the tiles are
    counted per device)."""
    narrow = jnp.dtype(prec.compute) == jnp.dtype(prec.param) and \
        jnp.dtype(prec.param).itemsize < jnp.dtype(prec.grad_reduce).itemsize
    plain = cfg.offload.params != "host" and not cfg.optimizer.update_in_backward
    if cfg.lora.rank > 0:
        untiled = tile_count(cfg.train.seq_len, sp, cfg.remat.seq_tile) == 1
        lean = plain and untiled and name in ADAPTERS
    else:
        lean = plain and name in PROJECTIONS
    return prec.param if lean and narrow else prec.grad_reduce
