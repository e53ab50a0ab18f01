"""Remat as data: per-checkpoint-name choices, presets, and the one function that
turns them into a `jax.checkpoint` policy plus a layer-scan structure.

Training, `plan` and `sweep` all build their step through `layer_scan` here.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np

from jaxmem.core import offload
from jaxmem.config.schema import Config, ConfigError, RematConfig
from jaxmem.config.names import ALL_NAMES, CheckpointName as CN

CHOICES = ("remat", "device", "offload")

_MATMULS = (CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ, CN.ATTN_CONTEXT, CN.ATTN_OUT, CN.MLP_GATE, CN.MLP_UP,
            CN.MLP_OUT)

# Every other matmul of a layer in forward order (the 1st, 3rd, 5th and 7th), plus the attention output.
_ALTERNATE = (CN.QUERY_PROJ, CN.VALUE_PROJ, CN.FLASH_RESIDUALS, CN.MLP_GATE, CN.MLP_OUT)


def _only(names, choice="device") -> dict:
    return {n.value: choice for n in names}


# Each preset: name -> choice for the tagged tensors (unlisted names are recomputed),
# an optional jax base policy for untagged values, and whether to checkpoint at all.
PRESETS: dict[str, dict] = {
    "none": {"checkpoint": False, "names": {}},
    "full": {"names": {}},
    "selective": {"names": _only(_MATMULS)},
    # torchtitan's op-level selective AC: every matmul output kept except every second one in forward order
    # (q kept, k recomputed, v kept, output projection recomputed, gate kept, up recomputed, down kept)
    "alternate_matmuls": {"names": _only(_ALTERNATE)},
    "dots": {"names": {}, "base": "dots_saveable"},
    "dots_no_batch": {"names": {}, "base": "dots_with_no_batch_dims_saveable"},
    "save_qkv_proj": {"names": _only((CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ))},
    "save_attn_out": {"names": _only((CN.ATTN_CONTEXT, CN.ATTN_OUT))},
    "offload_layer_inputs": {"names": _only((CN.LAYER_INPUT,), "offload")},
    "offload_selective": {"names": _only(_MATMULS, "offload")},
}


def name_choices(cfg: RematConfig) -> dict[str, str]:
    """Every checkpoint name with its resolved choice."""
    preset = PRESETS[cfg.preset]
    chosen = {n: "remat" for n in ALL_NAMES}
    if not preset.get("checkpoint", True) and not cfg.names:
        return {n: "device" for n in ALL_NAMES}
    chosen.update(preset["names"])
    chosen.update(cfg.names)
    return chosen


def uses_checkpoint(cfg: RematConfig) -> bool:
    return PRESETS[cfg.preset].get("checkpoint", True) or bool(cfg.names)


def offloaded_names(cfg: RematConfig) -> list[str]:
    return [n for n, c in name_choices(cfg).items() if c == "offload"]


def policy(cfg: RematConfig):
    """The jax.checkpoint policy for this config (None when nothing is checkpointed)."""
    if not uses_checkpoint(cfg):
        return None
    chosen = name_choices(cfg)
    saved = [n for n, c in chosen.items() if c == "device"]
    offloaded = [n for n, c in chosen.items() if c == "offload"]
    cp = jax.checkpoint_policies
    named = cp.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
        offload_src=offload.ACTIVATIONS_FROM, offload_dst=offload.ACTIVATIONS_TO)
    base = PRESETS[cfg.preset].get("base")
    return _with_base(getattr(cp, base), named, set(offloaded)) if base else named


def _with_base(base, named, offloaded: set):
    """Values the base policy saves stay on the device, except tagged values chosen for offload.

    (jax's save_from_both_policies only combines boolean policies, and the named
    offload policy returns saveable / offloadable / recompute markers.)
    """

    def combined(prim, *args, **params):
        decision = named(prim, *args, **params)
        if params.get("name") in offloaded:
            return decision
        return True if base(prim, *args, **params) else decision

    return combined


def check(cfg: Config) -> None:
    """remat.* against the presets, the checkpoint names and the choices (one-line ConfigError)."""
    r = cfg.remat
    if r.preset not in PRESETS:
        raise ConfigError(f"remat.preset: {r.preset!r} is unknown; use one of {', '.join(PRESETS)}")
    for name, choice in r.names.items():
        if name not in ALL_NAMES:
            raise ConfigError(f"remat.names.{name}: unknown checkpoint name; use one of {', '.join(ALL_NAMES)}")
        if choice not in CHOICES:
            raise ConfigError(f"remat.names.{name}: {choice!r} is not allowed; use one of "
                              f"{', '.join(CHOICES)}")
    if r.every_k < 1:
        raise ConfigError(f"remat.every_k: must be >= 1, got {r.every_k}")
    if r.seq_tile < 0:
        raise ConfigError(f"remat.seq_tile: must be >= 0 (0: off), got {r.seq_tile}")


def group_size(cfg: RematConfig, n_layers: int) -> int:
    """Layers per checkpointed group (every_k / nested; 1 otherwise). Its divisibility error is also a
    load-time rule (jaxmem.loader.CROSS_CHECKS)."""
    if cfg.granularity == "every_k":
        k = cfg.every_k
    elif cfg.granularity == "nested":
        k = max(d for d in range(1, int(math.isqrt(n_layers)) + 1) if n_layers % d == 0)
    else:
        return 1
    if n_layers % k:
        raise ConfigError(f"remat.every_k: {k} does not divide model.n_layers={n_layers}")
    return k


def _is_arrays(x) -> bool:
    return all(isinstance(leaf, (jax.Array, np.ndarray, np.generic)) for leaf in jax.tree.leaves(x))


def _checkpoint_arrays_only(ckpt, fn):
    """ckpt(fn) where the non-array arguments (the ForwardContext) are closed over, not traced."""

    def wrapped(*args):
        static = {i: a for i, a in enumerate(args) if not _is_arrays(a)}
        dynamic = [a for i, a in enumerate(args) if i not in static]

        def inner(*dyn):
            it = iter(dyn)
            return fn(*(static[i] if i in static else next(it) for i in range(len(args))))

        return ckpt(inner)(*dynamic)

    return wrapped


def _scan(body, h, xs):
    return jax.lax.scan(lambda c, x: (body(c, x), None), h, xs)[0]


def layer_scan(cfg: RematConfig, n_layers: int, fetch: Callable = lambda s: s):
    """Returns (scan_layers, segment) for ForwardContext.

    fetch(layer_state) runs at the top of each layer (host-offloaded params come
    to the device there).
    """
    pol = policy(cfg)
    ckpt = (lambda f: f) if pol is None else (lambda f: jax.checkpoint(f, policy=pol, prevent_cse=False))

    def fetched(body):
        return lambda h, s: body(h, fetch(s))

    def segment(name, fn):
        return _checkpoint_arrays_only(ckpt, fn) if cfg.granularity == "segments" and pol is not None else fn

    k = group_size(cfg, n_layers)

    def scan_layers(body, h, stacked):
        body = fetched(body)
        if cfg.granularity in ("layer", "segments") or pol is None:
            return _scan(ckpt(body) if cfg.granularity == "layer" else body, h, stacked)
        grouped = jax.tree.map(lambda x: x.reshape((n_layers // k, k) + x.shape[1:]), stacked)
        if cfg.granularity == "nested":  # outer groups keep only their input; layers inside keep the policy's
            outer = jax.checkpoint(lambda c, g: _scan(ckpt(body), c, g), prevent_cse=False,
                                   policy=jax.checkpoint_policies.nothing_saveable)
            return _scan(outer, h, grouped)
        return _scan(ckpt(lambda c, g: _scan(body, c, g)), h, grouped)

    return scan_layers, segment


# ---------------------------------------------------------------- what a policy keeps (read by the planner)

_BASE_SAVES = {  # names a jax base policy keeps by itself (it saves matmul outputs, untagged or tagged)
    "dots_saveable": _MATMULS,
    "dots_with_no_batch_dims_saveable": tuple(n for n in _MATMULS if n != CN.ATTN_CONTEXT),
}


def saved_across_backward(cfg: RematConfig, fused_attention: bool) -> dict[str, str]:
    """Per checkpoint name, where its per-layer value lives between the forward and the backward:
    device, host (offloaded) or remat (recomputed in the backward)."""
    choices = name_choices(cfg)
    if not uses_checkpoint(cfg):
        return {n: "device" for n in choices}
    out = {n: {"device": "device", "offload": "host"}.get(c, "remat") for n, c in choices.items()}
    if out[CN.LAYER_INPUT.value] == "remat":
        out[CN.LAYER_INPUT.value] = "device"  # the checkpointed layer's input is always a residual
    for n in _BASE_SAVES.get(PRESETS[cfg.preset].get("base"), ()):
        if n == CN.ATTN_CONTEXT and fused_attention:
            continue  # a fused attention kernel's output is no dot
        out[n.value] = "device" if out[n.value] == "remat" else out[n.value]
    if not fused_attention:
        out[CN.FLASH_RESIDUALS.value] = "remat"  # plain attention has no kernel residuals
    # The layer's output is never read by its own backward (the next layer keeps its input): whatever the
    # policy says (device or offload), autodiff drops it (deviceless compiles agree).
    out[CN.MLP_OUT.value] = "remat"
    return out


def keeps_attention_scores(cfg: RematConfig, fused_attention: bool) -> bool:
    """Whether plain (unfused) attention's S x S scores stay live across the backward."""
    if fused_attention:
        return False
    return not uses_checkpoint(cfg) or PRESETS[cfg.preset].get("base") == "dots_saveable"
