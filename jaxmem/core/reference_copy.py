"""A frozen copy of a full fine-tune's initial weights beside the train state, the reference policy an objective
compares with (preference.reference=model; a KL penalty's reference): the state's frozen part
(jaxmem.core.plugins.FROZEN), sharded like the params, never differentiated, never saved (a resume rebuilds it
from where the initial weights came from). The reference forward reads it in place of the params
(jaxmem.core.objective.reference_logprobs, through ReferenceCopy.reference_inputs).

The copy is bf16, or each layer's linear weights are stored int8 per channel or NF4 in blocks
(jaxmem.core.quant, QLoRA's schemes) while the norms, embedding and LM head stay bf16: the model is then merged
with [L] placeholders for those weights and the layer scan carries their stored forms, each dequantized at the
top of its layer (no dequantized copy of the whole stack). On the host, the stored weights live in pinned host
memory and come to the device a layer at a time.

A feature uses it with `ReferenceCopy(dtype, on_host)` as its program plug-in and `layout_part(dtype, on_host,
trainable, sizes)` as its part of the Layout; `copy_bytes` sizes it for a plan."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxmem.core import offload
from jaxmem.core.accounting import per_device
from jaxmem.core.plugins import FROZEN, ProgramPlugin
from jaxmem.core.quant import dequantize, quantize_int8, quantize_nf4, quantized_bytes
from jaxmem.core.step_state import assemble_state
from jaxmem.mesh.sharding import entry_axes
from jaxmem.runtime import memory_kinds_shim

COPY_DTYPE = jnp.bfloat16
NF4_BLOCK = 64
INT8_IN_AXES = (1,)  # int8 scales reduce over a stacked [L, ...] weight's first per-layer dim (its input dim)


def quantized_names(abstract_params: dict) -> tuple[str, ...]:
    """The layer entries stored quantized: the stacked linear weights ([L, ...] with two or more dims per layer)."""
    return tuple(sorted(k for k, v in abstract_params["layers"].items() if getattr(v, "ndim", 0) >= 3))


def _store(dtype: str, w):
    if dtype == "int8":
        return quantize_int8(w, INT8_IN_AXES)
    if dtype == "nf4":
        return quantize_nf4(w, NF4_BLOCK, False, batch_dims=1)
    return {"w": w.astype(COPY_DTYPE)}  # bf16 on the host: carried by the scan like a stored form


def stores_layers(dtype: str, on_host: bool) -> bool:
    """Whether the copy's linear weights ride the layer scan in a stored form (quantized, or on the host)."""
    return dtype != "bfloat16" or on_host


def make_copy(dtype: str, on_host: bool, params: dict, names: tuple[str, ...]) -> dict:
    """The frozen copy of `params`: COPY_DTYPE, with the layer weights `names` in their stored form where
    stores_layers (int8 / nf4 leaves, or {"w": bf16})."""
    copy = jax.tree.map(lambda x: x.astype(COPY_DTYPE), params)
    if not stores_layers(dtype, on_host):
        return copy
    layers = dict(copy["layers"], **{n: _store(dtype, params["layers"][n]) for n in names})
    return dict(copy, layers=layers)


def _unstore(dtype: str, piece, shape):
    return piece["w"] if dtype == "bfloat16" else dequantize(dtype, piece, shape, COPY_DTYPE)


def _stored_specs(dtype: str, spec, stored, sizes: dict[str, int]):
    """int8: values as the weight, scales without the reduced dim; nf4 (flattened per layer): split on the last
    dim over the weight's first sharded dim's axes where that divides, else replicated."""
    if dtype == "bfloat16":
        return {"w": spec}
    if dtype == "int8":
        return {"q": spec, "scale": P(*(None if i in INT8_IN_AXES else a for i, a in enumerate(spec)))}
    axes = next((a for a in spec if a is not None), None)
    ways = math.prod(sizes.get(a, 1) for a in entry_axes(axes))
    split = lambda x: axes is not None and x.ndim == 2 and x.shape[1] % ways == 0  # noqa: E731
    return jax.tree.map(lambda x: P(None, axes) if split(x) else P(*[None] * x.ndim), stored)


def layout_part(dtype: str, on_host: bool, trainable: dict, sizes: dict[str, int]) -> dict:
    """The Layout's frozen part: the copy's abstract tree and its specs (the planner's bill counts it as the
    state's frozen bytes)."""
    abstract_params = trainable["abstract_params"]
    names = quantized_names(abstract_params)
    abstract = jax.eval_shape(lambda p: make_copy(dtype, on_host, p, names), abstract_params)
    specs = trainable["param_specs"]
    if stores_layers(dtype, on_host):
        stored = {n: _stored_specs(dtype, P(*specs["layers"][n]), abstract["layers"][n], sizes) for n in names}
        specs = dict(specs, layers=dict(specs["layers"], **stored))
    return {"frozen_abstract": abstract, "frozen_specs": specs}


def copy_bytes(dtype: str, abstract_params: dict) -> tuple[int, int]:
    """(bytes of the copy's layers, bytes of the rest), unsharded."""
    names = quantized_names(abstract_params)
    layers = 0
    for name, a in abstract_params["layers"].items():
        stored = dtype if name in names else "bfloat16"
        layers += quantized_bytes(a.shape, stored, block=NF4_BLOCK, batch_dims=1, in_axes=INT8_IN_AXES)
    rest = sum(math.prod(a.shape) * 2 for k, v in abstract_params.items() if k != "layers"
               for a in jax.tree.leaves(v))
    return layers, rest


def stored_bytes(layout) -> int:
    """Per-device bytes of the copy's stored layer weights (the part an on-host copy keeps on the host)."""
    layers, specs = layout.frozen_abstract["layers"], layout.frozen_specs["layers"]
    stored = [k for k, v in layers.items() if isinstance(v, dict)]
    return per_device({k: layers[k] for k in stored}, {k: specs[k] for k in stored}, layout.mesh_sizes, in_bytes=True)


@dataclasses.dataclass
class ReferenceCopy(ProgramPlugin):
    dtype: str = "bfloat16"
    on_host: bool = False
    donates_params = False  # the copy is made from the loaded params
    assembles_state = False  # the state's frozen part is not assemble_state's (no layer-at-a-time host init)

    def frozen_layout(self, layout) -> dict:
        return {FROZEN: (layout.frozen_abstract, layout.frozen_specs)}

    def place_frozen(self, shardings: dict, abstract: dict) -> dict:
        """reference_memory=host: the copy's stored linear weights in pinned host memory (norms, embedding and LM
        head stay on the device)."""
        if not self.on_host:
            return shardings
        host = lambda s, a: memory_kinds_shim.host_sharding(s) if a.ndim else s  # noqa: E731
        frozen, stored = shardings[FROZEN], abstract[FROZEN]["layers"]
        layers = {k: jax.tree.map(host, v, stored[k]) if isinstance(stored[k], dict) else v
                  for k, v in frozen["layers"].items()}
        return dict(shardings, **{FROZEN: dict(frozen, layers=layers)})

    def _copy_fn(self, prog):
        names = quantized_names(prog.layout.abstract_params)
        return lambda params: make_copy(self.dtype, self.on_host, params, names)

    def fresh_state(self, prog, params, seed) -> dict:
        state = assemble_state(prog.cfg, prog.precision, prog.optimizer, params)
        state[FROZEN] = jax.jit(self._copy_fn(prog), out_shardings=prog.state_shardings[FROZEN])(params)
        return state

    def frozen_part(self, prog, load_params):
        """The copy rebuilt from the initial weights: checkpoint.init_from, else train.seed."""
        cfg, out, copy = prog.cfg, prog.state_shardings[FROZEN], self._copy_fn(prog)
        if cfg.checkpoint.init_from:
            return jax.jit(copy, out_shardings=out)(load_params(prog, cfg.checkpoint.init_from))
        return jax.jit(lambda: copy(prog.fresh_params(cfg.train.seed)), out_shardings=out)()

    def reference_inputs(self, params, frozen):
        return frozen, None

    # ------------------------------------------------------------ the reference forward of a stored copy
    def layer_fetch(self, cfg, layout, fetch):
        """A layer of the copy: (layer state, stored weights) -> the layer's state with each stored weight
        brought to the device (reference_memory=host) and dequantized; the policy's layers take `fetch`."""
        shapes = {n: layout.abstract_params["layers"][n].shape[1:] for n in quantized_names(layout.abstract_params)}
        dtype, on_host = self.dtype, self.on_host

        def fetch_layer(sliced):
            if not isinstance(sliced, tuple):
                return fetch(sliced)
            layer_state, stored = sliced
            out = nnx.to_pure_dict(layer_state) if isinstance(layer_state, nnx.State) else dict(layer_state)
            if on_host:
                out, stored = offload.to_device((out, stored))
            for name, piece in stored.items():
                out[name] = _unstore(dtype, piece, shapes[name])
            return out

        return fetch_layer

    def bind(self, prog, params, frozen, dropout_key, ctx):
        """The copy's stored layer weights (dicts in place of arrays) ride the layer scan beside the model's
        other layer params; the policy's params bind as they are."""
        stored = {n: v for n, v in params["layers"].items() if isinstance(v, dict)}
        if not stored:
            return params, ctx
        if self.on_host:  # the avals say host, as offload.mark_host_entries does for host params
            stored = offload.to_host(stored)
        layers = dict(params["layers"], **{n: jnp.zeros((jax.tree.leaves(v)[0].shape[0],), jnp.float32)
                                            for n, v in stored.items()})
        run_ctx = dataclasses.replace(ctx, scan_layers=lambda body, h, stacked: ctx.scan_layers(
            body, h, (stacked, stored)))
        return dict(params, layers=layers), run_ctx
