"""Host placement of optimizer state and parameters, the optimizer update on host or device, and the
compiled-memory check that offload really moved bytes.

`offload.optimizer: host` keeps master weights, m and v in pinned host memory
between steps; `offload.optimizer_update` says where AdamW runs (`host` under
`compute_on("device_host")`, or `device`: streamed in and out). Gradients cross
to the host once per step. `offload.params: host` keeps the parameters on the
host; each layer's weights come to the device inside the layer scan (and are
fetched again in the backward pass, so the layer loop must be checkpointed),
and their gradients go straight back to the host. Embedding, final norm and LM
head stay on the device: XLA 0.10.2 fails to compile the host update when the LM
head's gradient arrives from the device in transposed layout.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax.experimental.compute_on import compute_on

from jaxmem import memory_kinds_shim
from jaxmem.config import Config, ConfigError

DEVICE = jax.memory.Space.Device
HOST = jax.memory.Space.Host
GIB = 1024**3


def validate(cfg: Config) -> None:
    """One-line errors for lever combinations the step cannot honour, before any compile."""
    from jaxmem import remat

    if cfg.offload.params == "host":
        if not remat.uses_checkpoint(cfg.remat):
            raise ConfigError("offload.params=host: needs a remat preset other than none (layer weights are "
                              "fetched again in the backward pass instead of being kept on the device)")
        if cfg.train.grad_accum > 1:
            raise ConfigError("offload.params=host: needs train.grad_accum=1 (gradients land on the host)")


def host_keys(cfg: Config) -> tuple[str, ...]:
    """The train-state entries that live in pinned host memory between steps."""
    keys = ()
    if cfg.offload.optimizer == "host":
        keys += ("opt", "master")
    if cfg.offload.params == "host":
        keys += ("params",)
    return keys


def place_shardings(cfg: Config, shardings: dict) -> dict:
    """State shardings with the host-resident entries moved to pinned host memory."""
    out = dict(shardings)
    for key in host_keys(cfg):
        if key == "params":
            out[key] = dict(out[key], layers=jax.tree.map(memory_kinds_shim.host_sharding, out[key]["layers"]))
        elif key in out:
            out[key] = jax.tree.map(memory_kinds_shim.host_sharding, out[key])
    return out


def to_device(tree):
    return jax.tree.map(lambda x: jax.device_put(x, DEVICE), tree)


def to_host(tree):
    return jax.tree.map(lambda x: jax.device_put(x, HOST), tree)


def mark_host_entries(cfg: Config, state: dict) -> dict:
    """Names the host-resident inputs as host values inside the step.

    On real devices their avals already say host (a no-op); on compile-only
    devices the shim places the buffers on the host but the avals still say
    device, and compute_on needs every input in the same space.
    """
    out = {k: to_host(v) if k in host_keys(cfg) and k != "params" else v for k, v in state.items()}
    if cfg.offload.params == "host":
        out["params"] = dict(state["params"], layers=to_host(state["params"]["layers"]))
    return out


def _put_params(cfg: Config, params: dict, default_space) -> dict:
    if cfg.offload.params != "host" or params is None:
        return jax.tree.map(lambda x: jax.device_put(x, default_space), params)
    out = to_device({k: v for k, v in params.items() if k != "layers"})
    return dict(out, layers=to_host(params["layers"]))


def layer_fetch(cfg: Config, dtype) -> Callable:
    """fetch(layer_state) for remat.layer_scan: host weights come to the device, in the grad dtype."""
    if cfg.offload.params != "host":
        return lambda s: s
    return lambda s: jax.tree.map(lambda x: jax.device_put(x, DEVICE).astype(dtype), s)


def cast_for_grad(cfg: Config, params: dict, dtype) -> dict:
    """Params in the dtype gradients are reduced in; host layers are cast after their fetch instead."""
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)  # noqa: E731
    if cfg.offload.params != "host":
        return cast(params)
    return {k: v if k == "layers" else cast(v) for k, v in params.items()}


def run_update(cfg: Config, update: Callable, grads, opt_state, weights, params, scale):
    """Runs `update(grads, opt, weights, params, scale) -> (new_params, new_opt, new_weights, aux)` where
    the config says, and returns its results in the memory spaces the train state keeps them in."""
    on_host = cfg.offload.optimizer == "host" and cfg.offload.optimizer_update == "host"
    if on_host:
        new_params, new_opt, new_weights, aux = compute_on("device_host")(jax.jit(update))(
            *to_host((grads, opt_state, weights, params, scale)))
        aux = to_device(aux)
    else:
        new_params, new_opt, new_weights, aux = update(*to_device((grads, opt_state, weights, params, scale)))
    opt_space = HOST if cfg.offload.optimizer == "host" else DEVICE
    put = lambda tree, space: jax.tree.map(lambda x: jax.device_put(x, space), tree)  # noqa: E731
    return _put_params(cfg, new_params, DEVICE), put(new_opt, opt_space), put(new_weights, opt_space), aux


# ---------------------------------------------------------------- compiled memory


def memory_figures(compiled) -> dict:
    """Per-device bytes of a compiled step: device = argument + output - alias + temp; host_* pinned host."""
    ma = compiled.memory_analysis()
    f = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in (
        "argument", "output", "alias", "temp", "host_argument", "host_output", "host_alias", "host_temp")}
    f["device"] = f["argument"] + f["output"] - f["alias"] + f["temp"]
    f["host"] = f["host_argument"] + f["host_output"] - f["host_alias"] + f["host_temp"]
    return f


def offload_requested(cfg: Config) -> bool:
    from jaxmem import remat

    return bool(host_keys(cfg)) or bool(remat.offloaded_names(cfg.remat))


def offload_verdict(cfg: Config, figures: dict) -> str | None:
    """The line `plan` prints: host offload on GPU can be a silent no-op, so say what the compile shows."""
    if not offload_requested(cfg):
        return None
    if figures["host"] <= 0:
        return "offload requested but nothing moved (0 bytes in host memory in the compiled step)"
    return f"offload verified: {figures['host'] / GIB:.2f} GiB on host"
