"""The train step of an objective other than next-token cross-entropy (jaxmem.core.plugins.Objective: a
preference loss, ...): per micro-batch, the policy's per-token log-probs of the labels through the fused LM
head path (no [tokens, vocab] logits), the reference policy's where the objective compares with one, and
the objective's loss share; gradients accumulated in fp32 over the micro-batches, then the program's update.

The reference runs under stop_gradient: a forward on the plug-in's reference inputs (a LoRA base with its
adapters off, a frozen copy the state holds), or stored values the batch carries (plugins.REFERENCE_KEY).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ConfigError
from jaxmem.core import grad_dtype, offload
from jaxmem.core.plugins import FROZEN, REFERENCE_KEY
from jaxmem.core.step_state import GRADS_SCOPE, split_batch
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.mesh import sharding
from jaxmem.model.moe import ROUTER_METRICS, is_moe
from jaxmem.optim.hyper import schedule
from jaxmem.optim.layerwise import adam_count


def reference_logprobs(prog, chosen, logprob_fn, params, frozen, micro):
    """The reference policy's per-token log-probs [B, T] of a micro-batch (no gradient), or None."""
    if chosen.reference == "none":
        return None
    if chosen.reference == "batch":
        if micro[4] is None:
            raise ConfigError(f"train.objective={chosen.name}: the batch carries no stored reference log-probs")
        return jax.lax.bitcast_convert_type(micro[4], jnp.float32)
    inputs = prog.plugin.reference_inputs(params, frozen)
    if inputs is None:
        raise ConfigError(f"train.objective={chosen.name}: this run's state holds no reference policy; set "
                          "preference.reference=precompute or model (or train LoRA adapters: reference=base)")
    ref_params, ref_frozen = jax.lax.stop_gradient(inputs)
    return jax.lax.stop_gradient(logprob_fn(ref_params, *micro[:4], base=ref_frozen))


def micro_grad_fn(prog, chosen, logprob_fn):
    """grad_fn(params, micro, totals, frozen, key) -> (gradient of the micro-batch's loss share x the loss
    scale, (loss share, metric shares)); micro = (inputs, labels, segment ids, positions, stored reference)."""

    cfg = prog.cfg
    routed = is_moe(cfg.model)

    def micro_loss(params, micro, totals, frozen, key):
        policy = logprob_fn(params, *micro[:4], base=frozen, dropout_key=key, router_losses=routed)
        reference = reference_logprobs(prog, chosen, logprob_fn, params, frozen, micro)
        if routed:  # a mixture of experts: the router losses, weighted by their coefficients, a micro-batch's mean
            policy, router = policy
        share, metrics = chosen.micro_loss(policy, reference, micro[1], totals, micro[2])
        if routed:
            share = share + (cfg.model.router_aux_loss_coef * router["moe_aux_loss"]
                             + cfg.model.router_z_loss_coef * router["moe_z_loss"]) / prog.grad_accum
            metrics = dict(metrics, **{k: v / prog.grad_accum for k, v in router.items()})
        return share * totals["scale"], (share, metrics)

    return jax.grad(micro_loss, has_aux=True)


def make_step(prog, chosen, logprob_fn, updated_state):
    """step(state, batch) -> (state, metrics) minimizing `chosen`; `logprob_fn()` is the program's forward
    giving per-token log-probs (program.stage_fn with logprobs=True), `updated_state` its update."""
    cfg = prog.cfg
    grad_fn = micro_grad_fn(prog, chosen, logprob_fn())
    lr_at = schedule(cfg)

    def step(state, batch):
        state = offload.mark_host_entries(cfg, state)
        micro_batches = split_batch(batch) + (batch.get(REFERENCE_KEY),)
        scale = state["loss_scale"]["scale"] if "loss_scale" in state else jnp.float32(1.0)
        totals = dict(chosen.totals(micro_batches[1], micro_batches[2]), scale=scale)
        p_grad = grad_dtype.step_params(prog, grad_fn, state["params"], micro_batches, totals, state.get(FROZEN))
        with jax.named_scope(GRADS_SCOPE):
            grads, loss, metrics = _accumulate(prog, grad_fn, state, micro_batches, p_grad, totals)
        new_state, grad_norm, finite = updated_state(prog, state, grads, scale)
        count = offload.to_device(adam_count(new_state["opt"]))
        n_tokens = jnp.sum(micro_batches[1] != IGNORE_INDEX).astype(jnp.float32)
        return new_state, {"loss": loss, "grad_norm": grad_norm, "lr": lr_at(jnp.maximum(count - 1, 0)),
                           "tokens": n_tokens, "update_skipped": jnp.logical_not(finite), "loss_scale": scale,
                           **metrics}

    return step


def chosen_metrics(prog) -> tuple:
    """The metrics a step of the program's objective reports (and a mixture of experts' router statistics)."""
    routed = ROUTER_METRICS if is_moe(prog.cfg.model) else ()
    return prog.features.objective(prog.cfg).metric_names + tuple(routed)


def _accumulate(prog, grad_fn, state, micro_batches, p_grad, totals):
    """(gradients in fp32 summed over the micro-batches, loss, metrics): each micro-batch's shares summed."""
    cfg = prog.cfg
    grad_shardings = sharding.named(prog.mesh, prog.grad_specs)
    keyed = prog.plugin.keys_micro_batches(cfg)  # LoRA dropout's masks

    def one(micro, index):
        key = prog.plugin.micro_key(cfg, state["step"], index) if keyed else None
        g, aux = grad_fn(p_grad, micro, totals, state.get(FROZEN), key)
        return offload.constrain_device_part(cfg, g, grad_shardings), aux

    if prog.grad_accum == 1:
        grads, (loss, metrics) = one(jax.tree.map(lambda x: x[0], micro_batches), 0)
        return grads, loss, metrics

    def acc(carry, xs):
        g, aux = one(*xs)
        return (jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry[0], g),
                jax.tree.map(jnp.add, carry[1], aux)), None

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), p_grad),
                                             grad_shardings)
    aux_zero = (jnp.float32(0.0), {name: jnp.float32(0.0) for name in chosen_metrics(prog)})
    (grads, (loss, metrics)), _ = jax.lax.scan(acc, (zeros, aux_zero),
                                               (micro_batches, jnp.arange(prog.grad_accum)))
    return grads, loss, metrics
