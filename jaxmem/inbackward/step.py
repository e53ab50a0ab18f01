"""Optimizer-in-backward: each decoder layer's AdamW update runs inside the backward pass, right after
that layer's gradient exists, so the whole-stack gradient never does (`optimizer.update_in_backward`).

How. The layer scan is a `jax.custom_vjp` whose primal inputs include the layers' weights (fp32 master or
the params), their optimizer state, the clip factor and a scalar that collects squared gradient norms. Its
forward keeps each layer's input (full recompute at layer granularity); its backward walks the layers in
reverse, rebuilds one layer from its input, takes that layer's gradient, updates its weights and moments
in place (the stacked state is the loop carry), and hands the *new* values back where autodiff expects
the cotangents of those inputs. The train step reads them out of `jax.grad`'s result. Nothing outside the
step sees this: the primal inputs are used once, so no cotangent is summed or scaled on the way out.

Clipping. The global norm is known only after the last layer's gradient, when every layer has already
been updated, so the layers (and the embedding, final norm and LM head, for one rule) are clipped by the
*previous* step's global norm, kept in the train state as `grad_norm`; the first step is not clipped.
This is the trade-off: a loss spike is clipped one step late. The norm of this step's full gradient is
still computed exactly (each layer adds its squared norm) and reported.

Layer inputs. They are the only residuals (the backward rebuilds each layer from its input); with
`remat.preset=offload_layer_inputs` they are kept in pinned host memory instead of on the device.

Host offload. With `offload.optimizer=host` (and `offload.optimizer_update=device`) the fp32 master
weights and Adam's m and v stay in pinned host memory: the stacked host arrays are the backward's loop
carry, each layer's slice is fetched to the device, updated there and written back into the host stack in
place (`put_layer`: a dynamic update slice on the host array), so the device holds one layer's state at a
time. The embedding, final norm and LM head are streamed the same way after the backward. Adam's per-layer
step counts ([L] integers) ride on the device. The update computed on the host
(`offload.optimizer_update=host`) and `offload.params=host` are refused (jaxmem.config.validate).

Mixture of experts. The layer scan's carry is then (h, router statistics) (jaxmem.model.moe): the custom VJP
takes any carry tree, so the forward keeps each layer's (h, statistics) input and the backward hands the
router losses' cotangent back through the statistics with dh, layer by layer; the loss adds the weighted router
losses as the plain step does.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmem.optim import stochastic_round
from jaxmem.optim.layerwise import adam_count, apply_update, layer_key, put_layer, split_layers, take_layer
from jaxmem.core.plugins import ProgramPlugin
from jaxmem.model.moe import is_moe
from jaxmem.core.offload import DEVICE, HOST
from jaxmem.core import offload
from jaxmem.mesh import sharding
from jaxmem.optim.hyper import schedule
from jaxmem.core.step_state import GRADS_SCOPE, UPDATE_SCOPE, split_batch
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX


def clip_factor(prev_norm, clip_norm: float):
    """Scale for this step's gradients from the previous step's global norm (0: the first step, no clip)."""
    if clip_norm <= 0:
        return jnp.float32(1.0)
    return jnp.where(prev_norm > clip_norm, clip_norm / jnp.maximum(prev_norm, 1e-30), 1.0).astype(jnp.float32)


class _Static:
    """A hashable holder for a static pytree of abstract values (one layer's optimizer state layout)."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def _restructure(tree, like):
    """tree's leaves in like's structure (an nnx.State and the dict of the same keys flatten alike);
    the leaf shapes are checked so a different order cannot pass silently."""
    leaves, like_leaves = jax.tree.leaves(tree), jax.tree.leaves(like)
    if [x.shape for x in leaves] != [x.shape for x in like_leaves]:
        raise ValueError("update_in_backward: a layer's parameters and its optimizer weights differ in layout")
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _zero_cotangent(x):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)


def layer_specs(stacked_specs):
    """Per-layer partition specs: the stacked ones without their leading layer axis."""
    return jax.tree.map(lambda s: P(*tuple(s)[1:]), stacked_specs, is_leaf=lambda s: isinstance(s, P))


# Bytes of a quantized moment's codes (jaxmem.optim.codes) ride the cotangents as a float of the same width,
# bit for bit: no value is computed on them on the way.
_CODE_FLOAT = jnp.float8_e4m3fn


def ints_as_floats(tree):
    """Integer leaves as floats: a cotangent of an integer input cannot carry a value. Step counts become fp32
    (exact); uint8 codes of quantized moments are bitcast to an 8-bit float (no wider copy of the state)."""
    def one(x):
        if x.dtype == jnp.uint8:
            return jax.lax.bitcast_convert_type(x, _CODE_FLOAT)
        return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.integer) else x

    return jax.tree.map(one, tree)


def floats_as_ints(tree, like):
    """ints_as_floats undone, leaf by leaf in `like`'s dtypes."""
    def one(x, t):
        if t.dtype == jnp.uint8:
            return jax.lax.bitcast_convert_type(x, jnp.uint8) if x.dtype != jnp.uint8 else x
        return x.astype(t.dtype) if jnp.issubdtype(t.dtype, jnp.integer) else x

    return jax.tree.map(one, tree, like)


def make_scan(opt, *, param_dtype, grad_dtype, constrain_grad=lambda g: g, fetch=lambda t: t,
              offload_inputs=False, rounds=False):
    """scan_layers(body, h, stacked_params, state, opt_like, key_data) -> h, with the update in the backward.

    state = (weights or None, opt_state with `ints_as_floats`, clip_factor, squared_norm_seed); weights None
    means the params are the weights (no fp32 master). Each layer sees its params in `grad_dtype`, as the
    plain step's layers do. `constrain_grad(g)` places one layer's gradient (its reduce-scatter).
    `fetch(tree)` brings one layer's slice of weights and optimizer state to the device (host-resident
    stacks); the updated slice goes back into the stack's own memory space (`put_layer`). With
    `offload_inputs` (remat.preset=offload_layer_inputs) each layer's input is written to pinned host memory
    as the forward makes it and fetched back when the backward rebuilds that layer. With `rounds` (bf16 params
    without a master) layer i rounds stochastically with layer_key(the key of `key_data`, i), as the plain
    step's update does."""
    def update(dp, p, w, s, factor, like, key):
        """like = (one layer's weights, one layer's optimizer state), abstract: the trees the optimizer knows
        (the model hands the layer as an nnx.State)."""
        w_like, s_like = like
        w, s = fetch((w, s))
        g = constrain_grad(jax.tree.map(lambda x: x.astype(jnp.float32), dp))
        sq = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g))
        g = jax.tree.map(lambda x: x * factor, _restructure(g, w_like))
        weights = _restructure(p, w_like) if w is None else w
        new_p, new_s, new_w = apply_update(opt, g, floats_as_ints(s, s_like), weights, param_dtype, key)
        return _restructure(new_p, p), (None if w is None else new_w), ints_as_floats(new_s), sq

    cast = lambda p: jax.tree.map(lambda x: x.astype(grad_dtype), p)  # noqa: E731

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def stack(body, opt_like, h, params, state, consts, key_data):
        return _forward(body, h, params, consts)[0]

    def _forward(body, h, params, consts):
        def step(carry, p):
            return body(carry, cast(p), *consts), jax.device_put(carry, HOST) if offload_inputs else carry

        return jax.lax.scan(step, h, params)

    def stack_fwd(body, opt_like, h, params, state, consts, key_data):
        y, inputs = _forward(body, h, params, consts)
        return y, (inputs, params, state, consts, key_data)

    def stack_bwd(body, opt_like, res, dy):
        inputs, params, (weights, opt_state, factor, _), consts, key_data = res
        n = jax.tree.leaves(params)[0].shape[0]
        round_key = jax.random.wrap_key_data(key_data) if rounds else None

        def layer(carry, i):
            dh, params_all, weights_all, opt_all, sq = carry
            p = take_layer(params_all, i)
            x = take_layer(inputs, i)
            x = jax.device_put(x, DEVICE) if offload_inputs else x
            _, vjp = jax.vjp(lambda x, p32: body(x, p32, *consts), x, cast(p))
            dx, dp = vjp(dh)
            w = None if weights_all is None else take_layer(weights_all, i)
            new_p, new_w, new_s, sq_i = update(dp, p, w, take_layer(opt_all, i), factor, opt_like.value,
                                               layer_key(round_key, i))
            weights_all = None if weights_all is None else put_layer(weights_all, new_w, i)
            return (dx, put_layer(params_all, new_p, i), weights_all, put_layer(opt_all, new_s, i), sq + sq_i), None

        init = (dy, params, weights, opt_state, jnp.float32(0.0))
        (dx, new_params, new_weights, new_opt, sq), _ = jax.lax.scan(layer, init, jnp.arange(n - 1, -1, -1))
        state_ct = (new_weights, new_opt, jnp.zeros_like(factor), sq)
        return dx, new_params, state_ct, jax.tree.map(_zero_cotangent, consts), _zero_cotangent(key_data)

    stack.defvjp(stack_fwd, stack_bwd)

    def scan_layers(body, h, stacked, state, opt_like, key_data):
        closed, consts = jax.closure_convert(body, h, cast(take_layer(stacked, 0)))
        return stack(closed, _Static(opt_like), h, stacked, state, tuple(consts), key_data)

    return scan_layers


def make_step(prog, loss_sum_fn):
    """The train step of `prog` with the layer stack's update inside the backward (module docstring);
    `loss_sum_fn(prog, ctx)` is the program's loss (jaxmem.core.program.loss_sum_fn), handed in by the program."""
    cfg, prec = prog.cfg, prog.precision
    layer_shardings = sharding.named(prog.mesh, layer_specs(prog.grad_specs["layers"]))

    def constrain_grad(g):  # g is one layer's nnx.State; the shardings are a dict of the same keys
        leaves = jax.tree.leaves(layer_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        return jax.lax.with_sharding_constraint(g, jax.tree.unflatten(jax.tree.structure(g), leaves))

    # offload.optimizer=host (validated: with offload.optimizer_update=device): master, m and v stay in pinned
    # host memory, the loop carry of the backward; each layer's slice is fetched, updated on the device and
    # written back in place. Adam's per-layer step counts ([L] integers) ride on the device as fp32.
    fetch = offload.to_device if prog.layout.homes.optimizer_on_host else (lambda t: t)
    scan = make_scan(prog.optimizer, param_dtype=prec.param, grad_dtype=prec.grad_reduce,
                     constrain_grad=constrain_grad, fetch=fetch,
                     offload_inputs=cfg.remat.preset == "offload_layer_inputs", rounds=prec.stochastic_rounding)
    lr_at = schedule(cfg)

    def step(state, batch):
        state = offload.mark_host_entries(cfg, state)  # host avals on compile-only devices too
        # one micro-batch (validated): inputs, labels, segment ids, positions [rows, T] (or None)
        micro = jax.tree.map(lambda x: x[0], split_batch(batch))
        n_valid = jnp.maximum(jnp.sum(micro[1] != IGNORE_INDEX), 1).astype(jnp.float32)
        params, master = state["params"], state.get("master")
        factor = clip_factor(state["grad_norm"], cfg.optimizer.clip_norm)
        round_key = stochastic_round.step_key(cfg.train.seed, state["step"]) if prec.stochastic_rounding else None
        key_data = jnp.zeros((0,), jnp.uint32) if round_key is None else jax.random.key_data(round_key)
        loss = _loss_fn(prog, loss_sum_fn, scan, micro, n_valid, factor, state, key_data)
        rest = jax.tree.map(lambda x: x.astype(prec.grad_reduce), split_layers(params)[0])
        with jax.named_scope(GRADS_SCOPE):
            grads, (loss_sum, router) = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
                rest, params["layers"], None if master is None else master["layers"],
                ints_as_floats(_counts_to_device(state["opt"]["layers"])), jnp.float32(0.0))
        g_rest, new_layer_params, new_layer_weights, new_layer_opt, sq_layers = grads
        with jax.named_scope(UPDATE_SCOPE):
            new_p, new_s, new_w, sq_rest = _update_rest(prog, state, g_rest, factor, fetch, round_key)
        grad_norm = jnp.sqrt(sq_rest + sq_layers)
        layer_opt = state["opt"]["layers"]
        new_opt = {"rest": new_s, "layers": _home(floats_as_ints(new_layer_opt, layer_opt), layer_opt)}
        new_params = jax.lax.with_sharding_constraint(dict(new_p, layers=new_layer_params),
                                                      prog.state_shardings["params"])
        new_state = dict(state, step=state["step"] + 1, params=new_params, opt=new_opt, grad_norm=grad_norm)
        if master is not None:
            new_state["master"] = dict(new_w, layers=_home(new_layer_weights, master["layers"]))
        count = adam_count(new_opt)
        metrics = {"loss": loss_sum / n_valid, "grad_norm": grad_norm, "lr": lr_at(jnp.maximum(count - 1, 0)),
                   "tokens": n_valid, "update_skipped": jnp.bool_(False), "loss_scale": jnp.float32(1.0), **router}
        return new_state, metrics

    return step


def _counts_to_device(tree):
    return jax.tree.map(lambda x: offload.to_device(x) if jnp.issubdtype(x.dtype, jnp.integer) else x, tree)


def _home(tree, like):
    """tree's leaves in the memory spaces of like's (host-resident state stays there)."""
    return jax.tree.map(lambda x, h: jax.device_put(x, jax.typeof(h).memory_space), tree, like)


def _loss_fn(prog, loss_sum_fn, scan, micro, n_valid, factor, state, key_data):
    """loss(rest, layers, layer weights, layer optimizer state, squared-norm seed) -> (loss share, (loss sum,
    router statistics)): the program's loss with the layer scan that updates each layer in the backward; a
    mixture of experts adds its router losses weighted like the plain step's (jaxmem.core.program)."""
    cfg = prog.cfg
    routed = is_moe(cfg.model)  # the layer scan then carries the router statistics
    params, master = state["params"], state.get("master")
    opt_like = jax.eval_shape(lambda: (take_layer((master or params)["layers"], 0),
                                       take_layer(state["opt"]["layers"], 0)))

    def loss(rest, layers, layer_weights, layer_opt, sq_seed):
        layer_state = (layer_weights, layer_opt, factor, sq_seed)
        ctx = dataclasses.replace(prog.ctx, scan_layers=lambda body, h, stacked: scan(
            body, h, stacked, layer_state, opt_like, key_data))
        out = loss_sum_fn(prog, ctx)(dict(rest, layers=layers), *micro, router_losses=routed)
        if not routed:
            return out[0] / n_valid, (out[0], {})
        (loss_sum, n_micro), router = out
        extra = (cfg.model.router_aux_loss_coef * router["moe_aux_loss"]
                 + cfg.model.router_z_loss_coef * router["moe_z_loss"])
        return (loss_sum + n_micro.astype(jnp.float32) * extra) / n_valid, (loss_sum, router)

    return loss


def _update_rest(prog, state, g_rest, factor, fetch, round_key):
    """The embedding, final norm and LM head updated after the backward: (new params, new optimizer state,
    new master, their gradients' squared norm); rounded with the key the plain update gives them."""
    rest_shardings, _ = split_layers(sharding.named(prog.mesh, prog.grad_specs))
    g_rest = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: x.astype(jnp.float32), g_rest), rest_shardings)
    sq_rest = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(g_rest))
    w_rest, _ = split_layers(state.get("master") or state["params"])
    s_rest = state["opt"]["rest"]
    n_layers = prog.cfg.model.n_layers
    new_p, new_s, new_w = apply_update(prog.optimizer, jax.tree.map(lambda x: x * factor, g_rest), fetch(s_rest),
                                       fetch(w_rest), prog.precision.param, layer_key(round_key, n_layers))
    return new_p, _home(new_s, s_rest), _home(new_w, w_rest), sq_rest


class UpdateInBackward(ProgramPlugin):
    """optimizer.update_in_backward's plug-in (jaxmem.core.plugins): the program's step is make_step's."""

    @classmethod
    def from_config(cls, cfg) -> "UpdateInBackward | None":
        return cls() if cfg.optimizer.update_in_backward else None

    def make_step(self, prog, loss_sum_fn):
        return make_step(prog, loss_sum_fn)
