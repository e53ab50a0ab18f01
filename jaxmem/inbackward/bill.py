"""The update in the backward's terms of the analytic bill (jaxmem.plan.bill): one layer's gradient at a
time, its fp32 update temporaries, and a host-resident state streamed through the layer backward."""
from __future__ import annotations

import jax

from jaxmem.config.schema import Config
from jaxmem.core.accounting import (SCHEDULER_MEMORY_FRACTION, SCHEDULER_SLOP, itemsize, shard_elems, state_elem_bytes,
                                    state_elems, update_phase_bytes)
from jaxmem.core.layout import Layout, spec_leaves
from jaxmem.optim.layerwise import split_layers
from jaxmem.core.precision import Precision


def in_backward_grads(cfg: Config, layout: Layout, dtype) -> int:
    """Gradient bytes live at once with optimizer.update_in_backward: one layer's, and the largest of the
    embedding / final norm / LM head gradients (each is updated as soon as it exists: the compiled step
    updates the LM head during the backward, before the embedding's gradient appears)."""
    (rest, _), (rest_specs, _) = split_layers(layout.abstract_params), split_layers(layout.grad_specs)
    largest = max(shard_elems(x.shape, s, layout.mesh_sizes)
                  for x, s in zip(jax.tree.leaves(rest), spec_leaves(rest_specs), strict=True))
    return (state_elems(layout, layout.grad_specs, "layers") // cfg.model.n_layers + largest) * itemsize(dtype)


def in_backward_stream_bytes(cfg: Config, layout: Layout, prec: Precision, device_memory: int) -> int:
    """Device bytes of a host-resident state streamed through optimizer.update_in_backward's layer backward
    (offload.optimizer=host): the largest layer leaf's master, m and v brought in and their updated copies,
    and the next leaf's prefetched while that fits under XLA's scheduler limit (read off deviceless compiles:
    benchmarks/constants.md, inbackward)."""
    _, layer_params = split_layers(layout.abstract_params)
    _, layer_specs = split_layers(layout.opt_specs)
    per_elem = sum(state_elem_bytes(layout, prec))
    leaves = sorted((shard_elems(x.shape, s, layout.mesh_sizes) // cfg.model.n_layers
                     for x, s in zip(jax.tree.leaves(layer_params), spec_leaves(layer_specs), strict=True)),
                    reverse=True)
    peak = 2 * leaves[0] * per_elem
    if len(leaves) > 1 and peak + leaves[1] * per_elem <= SCHEDULER_MEMORY_FRACTION * device_memory * SCHEDULER_SLOP:
        peak += leaves[1] * per_elem
    return int(peak)


def _state(d) -> None:
    d.device["grads"] = in_backward_grads(d.cfg, d.layout, d.prec.grad_reduce)
    d.whole_model_grads, d.rest_donated, d.plain_update, d.update_in_layers = False, False, False, True


def _temporaries(d) -> None:
    """The layer's gradient is in `grads`; its fp32 update temporaries here."""
    d.device["temporaries"] -= d.layer_full * itemsize(d.prec.grad_reduce)
    if "opt" in d.layout.host_state:  # one layer's state streamed through the device, leaf by leaf
        d.device["temporaries"] += in_backward_stream_bytes(d.cfg, d.layout, d.prec, d.memory)


def _update(d) -> None:
    """The embedding / final norm / LM head are updated after the backward, streamed like a host update."""
    if "opt" in d.layout.host_state:
        d.update_phase = update_phase_bytes(d.cfg, d.layout, d.prec, d.device, d.memory)


BILL_TERMS = (("state", _state), ("temporaries", _temporaries), ("update", _update))
