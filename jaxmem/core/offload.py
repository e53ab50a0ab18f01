"""Host placement of optimizer state, parameters and offloaded activations, and the optimizer update on
host or device.

`offload.optimizer: host` keeps master weights, m and v in pinned host memory
between steps; `offload.optimizer_update` says where AdamW runs (`host` under
XLA host compute (`compat.host_compute`), or `device`: streamed in and out). Gradients cross
to the host once per step. `offload.params: host` keeps the parameters on the
host; each layer's weights come to the device inside the layer scan (and are
fetched again in the backward pass, so the layer loop must be checkpointed),
and their gradients go straight back to the host. Embedding, final norm and LM
head stay on the device: XLA 0.10.2 fails to compile the host update when the LM
head's gradient arrives from the device in transposed layout.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jaxmem.runtime import compat, memory_kinds_shim
from jaxmem.config.schema import Config

DEVICE = jax.memory.Space.Device
HOST = jax.memory.Space.Host
# Where activations that a remat policy offloads (remat.names.X=offload) live between forward and backward;
# jaxmem.core.remat builds its jax.checkpoint policy with these.
ACTIVATIONS_FROM, ACTIVATIONS_TO = "device", memory_kinds_shim.HOST_KIND


@dataclasses.dataclass(frozen=True)
class StateHomes:
    """Where the train state lives between steps and where the optimizer update runs, resolved once from
    `offload.*` (jaxmem.core.layout.Layout.homes): the planner and the steps decide on these, not on the
    config's strings."""

    params: str  # "device" or "host": the decoder layers' weights (embedding, final norm, LM head stay)
    optimizer: str  # "device" or "host": master weights, m and v
    update: str  # "device" or "host": where AdamW runs (state on the host + "device": streamed through)

    @classmethod
    def from_config(cls, cfg: Config) -> "StateHomes":
        o = cfg.offload
        update = "host" if o.optimizer == "host" and o.optimizer_update == "host" else "device"
        return cls(params=o.params, optimizer=o.optimizer, update=update)

    @property
    def params_on_host(self) -> bool:
        return self.params == "host"

    @property
    def optimizer_on_host(self) -> bool:
        return self.optimizer == "host"

    @property
    def update_on_host(self) -> bool:
        return self.update == "host"

    @property
    def update_streamed(self) -> bool:
        """The state on the host, the update on the device: master, m and v stream in and back out."""
        return self.optimizer_on_host and not self.update_on_host

    @property
    def rest_in_pieces(self) -> bool:
        """A streamed update moves the non-layer leaves' state (embedding, LM head) a piece at a time
        (jaxmem.optim.layerwise.rest_chunks) where the layers' weights live on the host too: its peak is then that
        state. With the layers on the device the peak is the backward's, and the pieces' loop kept the old
        embedding and LM head live through it: moved whole there (benchmarks/constants.md, offload)."""
        return self.update_streamed and self.params_on_host

    def host_keys(self) -> tuple[str, ...]:
        """The train-state entries that live in pinned host memory between steps."""
        return (("opt", "master") if self.optimizer_on_host else ()) + (("params",) if self.params_on_host else ())


def host_keys(cfg: Config) -> tuple[str, ...]:
    """The train-state entries that live in pinned host memory between steps."""
    return StateHomes.from_config(cfg).host_keys()


def place_shardings(cfg: Config, shardings: dict, abstract: dict) -> dict:
    """State shardings with the host-resident entries moved to pinned host memory.

    Scalars (Adam's step count) stay on the device: XLA 0.10.2 fails to compile
    ("doesn't have correct host memory space color") when a host scalar argument
    feeds the host computation.
    """
    out = dict(shardings)
    host = lambda s, a: memory_kinds_shim.host_sharding(s) if a.ndim else s  # noqa: E731
    for key in host_keys(cfg):
        if key == "params":
            out[key] = dict(out[key], layers=jax.tree.map(host, out[key]["layers"], abstract[key]["layers"]))
        elif key in out:
            out[key] = jax.tree.map(host, out[key], abstract[key])
    return out


def to_device(tree):
    return jax.tree.map(lambda x: jax.device_put(x, DEVICE), tree)


def to_host(tree):
    return jax.tree.map(lambda x: jax.device_put(x, HOST), tree)


def _state_home(tree):
    """Host-resident optimizer state between steps: arrays on the host, scalars on the device."""
    return jax.tree.map(lambda x: jax.device_put(x, HOST if x.ndim else DEVICE), tree)


def mark_host_entries(cfg: Config, state: dict) -> dict:
    """Names the host-resident inputs as host values inside the step.

    On real devices their avals already say host (a no-op); on compile-only
    devices the shim places the buffers on the host but the avals still say
    device, and compute_on needs every input in the same space.
    """
    out = {k: _state_home(v) if k in host_keys(cfg) and k != "params" else v for k, v in state.items()}
    if cfg.offload.params == "host":
        out["params"] = dict(state["params"], layers=to_host(state["params"]["layers"]))
    return out


def layer_fetch(cfg: Config, dtype) -> Callable:
    """fetch(layer_state) for remat.layer_scan: host weights come to the device, in the grad dtype."""
    if cfg.offload.params != "host":
        return lambda s: s
    return lambda s: jax.tree.map(lambda x: jax.device_put(x, DEVICE).astype(dtype), s)


def constrain_device_part(cfg: Config, tree: dict, shardings: dict) -> dict:
    """Sharding constraints for a params-shaped tree (gradients, new params) inside the step. With
    `offload.params: host` the layer entries already sit on the host, where their placement decides (layer
    gradients land next to the host weights, and new host params come from the update); only the rest is
    constrained on the device."""
    if cfg.offload.params != "host":
        return jax.lax.with_sharding_constraint(tree, shardings)
    rest = {k: v for k, v in tree.items() if k != "layers"}
    rest = jax.lax.with_sharding_constraint(rest, {k: shardings[k] for k in rest})
    return dict(rest, layers=tree["layers"])


def cast_for_grad(cfg: Config, params: dict, dtype) -> dict:
    """Params in the dtype gradients are reduced in; host layers are cast after their fetch instead."""
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    if cfg.offload.params != "host":
        return cast(params)
    return {k: v if k == "layers" else cast(v) for k, v in params.items()}


def run_update(cfg: Config, update: Callable, grads, opt_state, weights, params, scale):
    """Runs `update(grads, opt, weights, params, scale, fetch=, homes=)` (jaxmem.optim.layerwise.layerwise_update)
    where the config says: on the host (compat.host_compute), or on the device with each
    layer's slice of a host-resident state streamed in and its results streamed back."""
    opt_home = HOST if cfg.offload.optimizer == "host" else DEVICE
    layer_home = HOST if cfg.offload.params == "host" else DEVICE
    put = lambda space: (lambda tree: jax.tree.map(lambda x: jax.device_put(x, space), tree))  # noqa: E731
    if cfg.offload.optimizer == "host" and cfg.offload.optimizer_update == "host":
        args = to_host((grads, opt_state, weights, params, scale))
        # Outputs stay where they will live; scalars (Adam's count, aux) come back to the device.
        spaces = jax.tree.map(lambda a: HOST if a.ndim else DEVICE, jax.eval_shape(update, *args))
        new_params, new_opt, new_weights, aux = compat.host_compute(update, spaces)(*args)
        rest = {k: v for k, v in new_params.items() if k != "layers"}
        layers = put(layer_home)(new_params["layers"])
        return dict(to_device(rest), layers=layers), _state_home(new_opt), new_weights, to_device(aux)
    state_home = _state_home if opt_home == HOST else put(DEVICE)
    homes = {"rest": (put(DEVICE), state_home, state_home),
             "layers": (put(layer_home), put(opt_home), put(opt_home))}
    return update(grads, opt_state, weights, params, scale, fetch=to_device, homes=homes)
