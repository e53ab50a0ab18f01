"""The analytic bill's terms of where the train state lives (jaxmem.plan.bill runs them after the base model's
own in their phases, for every run: they do nothing where everything is on the device): state moved to pinned
host memory, the update on the host or streamed through the device, and what XLA's scheduler brings forward
of it. The mechanism is jaxmem.core.offload's."""
from __future__ import annotations

import numpy as np

from jaxmem.config.names import CheckpointName as CN
from jaxmem.config.schema import Config
from jaxmem.core.accounting import (head_grad_itemsize, quantized_layer_update_bytes, scheduler_limit, state_bytes,
                                    state_elem_bytes, streamed_rest_elems, update_phase_bytes)
from jaxmem.core.layout import Layout
from jaxmem.core.precision import Precision


def host_params_layer_bytes(cfg: Config, layout: Layout, prec: Precision) -> int:
    """One layer's temporaries in the backward with its weights fetched from the host (offload.params=host):
    its gradient, in the weights' dtype (the fetch's cast to the gradient dtype transposes back to it)
    before it goes to the host; no rebuilt full-width layer is held with it (`jaxmem explain` of qwen2.5-7b
    widths, 1 x h100-80g: the layer's bf16 gradients and the MLP's [T, d_ff] values at the peak)."""
    return state_bytes(layout, layout.param_specs, prec.param, part="layers") // cfg.model.n_layers


def update_prefetch_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int],
                          device_memory: int) -> int:
    """Bytes of a streamed optimizer update (state on the host, weights on the device) that XLA's scheduler
    brings forward into the layers' backward while they fit under its memory limit: the first updated
    leaf's fp32 master, m and v (the largest non-layer leaf) and the buffer the layers' new weights are
    written into (`jaxmem explain` of the 1-GPU 128k recipe: the LM head's three fp32 copies and the new bf16
    layer weights live at the device peak in the MLP backward; benchmarks/constants.md, offload)."""
    largest = next(iter(streamed_rest_elems(layout)), 0)
    new_layers = state_bytes(layout, layout.param_specs, prec.param, part="layers")
    prefetch = int(largest * sum(state_elem_bytes(layout, prec))) + new_layers
    phase = sum(device.values())  # an upper bound of the backward's own peak
    return prefetch if phase + prefetch <= scheduler_limit(device, device_memory) else 0


def state(d) -> None:
    homes = d.layout.host_state
    if homes:  # the stored weights stay (a skipped or a piecewise update), and no update runs after the backward
        d.rest_donated, d.plain_update = False, False
    d.grad_through_layers = "opt" not in homes  # the LM head's dot runs before the layer scan
    d.layers_on_host = "params" in homes


def host(d) -> None:
    """The optimizer state (fp32 master, m, v) and the decoder layers in host memory. With the update on the
    host it holds the fp32 gradients, new m and v and new params there (compiles agree). The decoder layers'
    gradients go straight to the host with their weights, whatever runs the update (compiled llama3-8b
    1 x rtx4090-24g recipe and qwen2.5-7b 1 x h100-80g: the [L, ...] layer gradient buffers are host memory); only the
    embedding / final norm / LM head gradients are device buffers, and with the update on the host those too
    go (explain: the LM head's bf16 gradient is live at the layer peak, the donated embedding is not)."""
    layout, prec, device, host = d.layout, d.prec, d.device, d.host
    homes = layout.host_state
    params = device["params"]
    if "opt" in homes:
        for k in ("master", "opt_m", "opt_v"):
            host[k], device[k] = device[k], 0
        if layout.homes.update_on_host:
            fp32_grads = state_bytes(layout, layout.opt_specs, np.float32)
            host["temporaries"] = fp32_grads + host["opt_m"] + host["opt_v"] + params
    if "params" not in homes:
        return
    host["params"] = state_bytes(layout, layout.param_specs, prec.param, part="layers")
    device["params"] -= host["params"]
    device["grads"] -= state_bytes(layout, layout.grad_specs, prec.grad_reduce, part="layers")
    if layout.homes.update_on_host:
        device["grads"] = 0
        if d.trains_head:  # and the LM head's gradient stays in the compute dtype (explain: bf16)
            device["logits"] -= d.head_full * (head_grad_itemsize(layout, prec) - d.cd)
    device["temporaries"] = host_params_layer_bytes(d.cfg, layout, prec)
    # the layer's weight gradients complete after the MLP's gate / up input gradients are dead
    device["working_set"] -= 2 * d.per_name[CN.MLP_GATE.value] * d.cd


def update(d) -> None:
    layout = d.layout
    streamed = layout.homes.update_streamed and not d.update_in_layers
    if streamed:
        d.update_phase = update_phase_bytes(d.cfg, layout, d.prec, d.device, d.memory)
    if streamed and layout.optimizer.quantized:  # the layers' requantizing can be the larger phase
        d.update_phase = max(d.update_phase, quantized_layer_update_bytes(d.cfg, layout, d.prec, d.device))
    if streamed and "params" not in layout.host_state:
        d.device["temporaries"] += update_prefetch_bytes(d.cfg, layout, d.prec, d.device, d.memory)


def absent(d) -> None:
    """The decoder layers' gradients are not allocated yet while the loss runs, with the optimizer state on the
    host (`jaxmem explain` of a full-remat step: the layer gradient buffers appear at the layer scan's
    backward, after the loss's logits are dead)."""
    homes = d.layout.host_state
    if "opt" in homes and "params" not in homes and not d.update_in_layers:
        d.absent_in_loss = state_bytes(d.layout, d.layout.grad_specs, d.prec.grad_reduce, part="layers")


TERMS = {"state": state, "host": host, "update": update, "absent": absent}
