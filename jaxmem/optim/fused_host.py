"""The host update through the one-pass AdamW kernel (kernels.host_update=fused, jaxmem.kernels.host_adamw).

It runs `whole_update`'s step (unscale, clip by the global norm, AdamW, bf16 params) for the state kinds the
kernel covers: AdamW with fp32 or block-quantized int8 / int4 moments (jaxmem.optim.codes), an fp32 master and
bf16 params rounded to nearest. The step's scalars
(learning rate, bias corrections, the clip multiplier) are computed here as optax computes them, each tensor
then goes through the kernel once, and the optax state comes back with the same structure and counts, so a
checkpoint, a resume or a switch to the XLA update reads it unchanged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from jaxmem.config.schema import Config, ConfigError
from jaxmem.kernels.host_adamw import (BuildError, host_adamw, host_adamw_lowbit, host_adamw_reference, lowbit_tables,
                                      register)
from jaxmem.optim import codes, rows
from jaxmem.optim.hyper import decay_mask, schedule
from jaxmem.optim.kind import state_kind
from jaxmem.optim.states import KINDS
from jaxmem.optim.layerwise import split_layers
from jaxmem.optim.specs import quantized_specs

_COUNTED = (optax.ScaleByAdamState, optax.ScaleByScheduleState)


def not_covered(cfg: Config, param_dtype) -> str | None:
    """Why the kernel cannot run this config's update (one line naming the key), or None where it can."""
    kind, p = state_kind(cfg), cfg.precision
    if not kind.fused_host:
        covered = ", ".join(k.name for k in KINDS if k.fused_host)
        return (f"it keeps AdamW's moments in one of {covered} (optimizer.name={kind.name}, "
                f"precision.moment_dtype={kind.moment})")
    if not p.master_weights:
        return "it updates an fp32 master copy (precision.master_weights=false)"
    if jnp.dtype(param_dtype) != jnp.bfloat16:
        return f"it writes bfloat16 params (precision.param_dtype={jnp.dtype(param_dtype).name})"
    return None


def choose(cfg: Config, platform: str, n_devices: int, param_dtype, mesh=None,
           specs=None) -> "FusedAdamW | None":
    """The fused update for a program of `n_devices` `platform` devices, or None for XLA's (kernels.host_update).
    `auto` takes the kernel in a one-device CPU program whose state kind it covers and where it builds, else
    XLA's update: over several devices GSPMD would run the custom call on whole tensors, and a GPU program's
    host computation through the kernel compiles (the kernel registered with the CUDA plugin) but has not yet
    run on a GPU, so there it is `fused`'s to ask for. Over several devices `fused` runs the kernel on each
    device's shard (a shard_map over `mesh` with the weights' partition `specs`). An explicit `fused` that
    cannot run raises ConfigError, before any compile."""
    impl = cfg.kernels.host_update
    if impl == "xla" or not (cfg.offload.optimizer == "host" and cfg.offload.optimizer_update == "host"):
        return None
    reason = not_covered(cfg, param_dtype)
    if reason is None and platform not in ("cpu", "gpu"):
        reason = f"it runs in CPU or GPU programs (this one: {n_devices} {platform} device(s))"
    if reason is None and n_devices > 1 and (mesh is None or specs is None):
        reason = f"over several devices it needs the mesh and the weights' partition specs ({n_devices} devices)"
    if reason is None and impl == "auto" and (platform == "gpu" or n_devices > 1):
        return None
    if reason is None:
        try:
            register(platform)
            return FusedAdamW.from_config(cfg, mesh if n_devices > 1 else None, specs)
        except BuildError as e:
            reason = str(e)
    if impl == "fused":
        raise ConfigError(f"kernels.host_update=fused cannot run here: {reason}; use auto or xla")
    return None


@dataclasses.dataclass(frozen=True)
class FusedAdamW:
    b1: float
    b2: float
    eps: float
    weight_decay: float
    lr: Callable  # the schedule: step count -> learning rate
    mesh: Any = None  # over several devices: the kernel runs on each device's shard
    specs: Any = None  # the weights' PartitionSpecs (the tree of the master weights)

    @classmethod
    def from_config(cls, cfg: Config, mesh=None, specs=None) -> "FusedAdamW":
        o = cfg.optimizer
        return cls(o.b1, o.b2, o.eps, o.weight_decay, schedule(cfg), mesh, specs)

    def kernel(self, spec: PartitionSpec | None, mu, nu, decay: float) -> Callable:
        """(grad, weights, mu, nu, scalars) -> (weights, mu, nu, bf16 params) through the kernel, mu and nu
        fp32 arrays or QTensors as given; on whole tensors or, with a mesh, on each device's shard of `spec`
        (the scalars replicated). A quantized tensor whose shards would cut its blocks (its last dim split
        finer than a block) runs the same step in jnp instead (_lowbit_jnp: GSPMD splits it)."""
        hyper = dict(b1=self.b1, b2=self.b2, eps=self.eps, decay=decay)
        call = functools.partial(_lowbit, **hyper) if codes.is_quantized(mu) else functools.partial(host_adamw, **hyper)
        if self.mesh is None:
            return call
        m_spec, v_spec = (self._moment_spec(spec, x) for x in (mu, nu))
        if m_spec is None or v_spec is None:
            return functools.partial(_lowbit_jnp, **hyper)
        return jax.shard_map(call, mesh=self.mesh, in_specs=(spec, spec, m_spec, v_spec, PartitionSpec()),
                             out_specs=(spec, m_spec, v_spec, spec), check_vma=False)

    def _moment_spec(self, spec: PartitionSpec, moment):
        """A moment's spec for the shard_map: the weight's; a QTensor's codes and scales split with it, or None
        where a shard would hold part of a block (the scales then stay whole: codes.py's rule)."""
        if not codes.is_quantized(moment):
            return spec
        split = quantized_specs(moment, spec, dict(self.mesh.shape))
        return split if split.codes == split.scales else None


def _lowbit_jnp(grad, weights, mu: codes.QTensor, nu: codes.QTensor, scalars, **hyper):
    """_lowbit's step in jnp: the moments dequantized, the kernel's reference arithmetic, requantized."""
    w, m, v, p = host_adamw_reference(grad, weights, codes.dequantize(mu), codes.dequantize(nu), scalars, **hyper)
    return w, codes.quantize(m, mu.code, mu.block), codes.quantize(v, nu.code, nu.block), p


def _lowbit(grad, weights, mu: codes.QTensor, nu: codes.QTensor, scalars, **hyper):
    """host_adamw_lowbit on QTensor moments: (weights, mu, nu, bf16 params)."""
    m_code, v_code = codes.CODES[mu.code], codes.CODES[nu.code]
    tables = lowbit_tables(m_code, v_code)
    w, mc, ms, vc, vs, p = host_adamw_lowbit(grad, weights, mu.codes, mu.scales, nu.codes, nu.scales, scalars, tables,
                                             bits=m_code.bits, length=mu.block, v_sqrt_linear=v_code.sqrt_linear,
                                             **hyper)
    return w, dataclasses.replace(mu, codes=mc, scales=ms), dataclasses.replace(nu, codes=vc, scales=vs), p


def _counted(state) -> dict:
    """{ScaleByAdamState: its node, ScaleByScheduleState: its node} of one chain state."""
    return {type(s): s for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, _COUNTED))
            if isinstance(s, _COUNTED)}


def _rebuilt(state, mu, nu, adam_count, schedule_count):
    def fix(s):
        if isinstance(s, optax.ScaleByAdamState):
            return s._replace(count=jnp.broadcast_to(adam_count, s.count.shape), mu=mu, nu=nu)
        if isinstance(s, optax.ScaleByScheduleState):
            return s._replace(count=jnp.broadcast_to(schedule_count, s.count.shape))
        return s

    return jax.tree.map(fix, state, is_leaf=lambda s: isinstance(s, _COUNTED))


def _part(hyper: FusedAdamW, g, state, w, positioned_specs, multiplier, finite):
    """One chain state's tensors (the non-layer params, or the stacked layers) through the kernel.
    `positioned_specs`: (each weight's position in the tree of `w`, the specs in that order)."""
    nodes = _counted(state)
    adam, first = nodes[optax.ScaleByAdamState], lambda c: c.reshape(-1)[0]  # noqa: E731
    # a layer stack's counts are [layers], all equal
    adam_count, schedule_count = first(adam.count), first(nodes[optax.ScaleByScheduleState].count)
    t = optax.safe_increment(adam_count)
    bc1, bc2 = 1 - hyper.b1 ** t, 1 - hyper.b2 ** t  # optax's bias corrections, in the same dtype
    skip = jnp.where(finite, 0.0, 1.0)
    scalars = jnp.stack([hyper.lr(schedule_count), bc1, bc2, multiplier, skip]).astype(jnp.float32)
    positions, specs = positioned_specs

    def one(g, w, m, v, decays, position):
        g = g if g.dtype in (jnp.float32, jnp.bfloat16) else g.astype(jnp.float32)
        return hyper.kernel(specs[position], m, v, hyper.weight_decay if decays else 0.0)(g, w, m, v, scalars)

    out = jax.tree.map(one, g, w, adam.mu, adam.nu, decay_mask(w), positions)
    pick = lambda i: jax.tree.map(lambda _, o: o[i], w, out)  # noqa: E731
    new_w, new_mu, new_nu, new_p = (pick(i) for i in range(4))
    new_counts = (jnp.where(finite, t, adam_count), jnp.where(finite, optax.safe_increment(schedule_count),
                                                             schedule_count))
    return new_p, _rebuilt(state, new_mu, new_nu, *new_counts), new_w


def fused_update(hyper: FusedAdamW, grads, opt_state, weights, finite, multiplier):
    """whole_update's step through the kernel: (new_params, new_opt_state, new_weights). `multiplier` is the
    clip factor over the loss scale; `finite` False (a non-finite fp16 step) keeps every old value."""
    g_rest, g_layers = split_layers(rows.densify(grads))
    w_rest, w_layers = split_layers(weights)
    # each weight's partition spec (None without a mesh), found by the weight's position among the leaves
    leaves, tree = jax.tree.flatten(weights)
    specs = (jax.tree.leaves(hyper.specs, is_leaf=lambda x: isinstance(x, PartitionSpec)) if hyper.mesh
             else [None] * len(leaves))
    at_rest, at_layers = split_layers(jax.tree.unflatten(tree, range(len(leaves))))
    p_rest, s_rest, new_w_rest = _part(hyper, g_rest, opt_state["rest"], w_rest, (at_rest, specs), multiplier,
                                       finite)
    p_layers, s_layers, new_w_layers = _part(hyper, g_layers, opt_state["layers"], w_layers, (at_layers, specs),
                                             multiplier, finite)
    return (dict(p_rest, layers=p_layers), {"rest": s_rest, "layers": s_layers},
            dict(new_w_rest, layers=new_w_layers))
