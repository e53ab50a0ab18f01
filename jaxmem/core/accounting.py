"""Bytes per device of a layout's trees, as the step shards them: the arithmetic the analytic bill
(jaxmem.plan.bill) and each feature's bill terms share."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config.schema import Config
from jaxmem.core import embed_grad
from jaxmem.core.grad_dtype import planned_dtype
from jaxmem.core.layout import Layout, spec_leaves
from jaxmem.optim.layerwise import split_layers
from jaxmem.core.precision import Precision
from jaxmem.core.step_state import assemble_state
from jaxmem.optim.choice import make_optimizer
from jaxmem.optim.specs import layerwise_state_specs
from jaxmem.mesh.sharding import spec_ways

# XLA's GPU scheduler memory limit (gpu_hlo_schedule.cc GetSchedulerMemoryLimit): SCHEDULER_MEMORY_FRACTION of
# the device memory, less the device-resident arguments, times xla_gpu_memory_limit_slop_factor (its default).
SCHEDULER_MEMORY_FRACTION, SCHEDULER_SLOP = 0.80, 0.95


def itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def shard_elems(shape, spec, sizes) -> int:
    return math.prod(shape) // spec_ways(spec, sizes)


def per_device(tree, specs, sizes: dict[str, int], *, in_bytes: bool = False) -> int:
    """Per-device elements (or bytes, each leaf at its own dtype) of `tree` sharded by `specs`."""
    return sum(shard_elems(x.shape, s, sizes) * (x.dtype.itemsize if in_bytes else 1)
               for x, s in zip(jax.tree.leaves(tree), spec_leaves(specs), strict=True))


def model_elems(layout: Layout, part: str) -> int:
    """Per-device elements of the model's `part` as the step uses it (all-gathered over the data axes)."""
    return per_device(layout.model_abstract_params[part], layout.model_gathered_specs[part], layout.mesh_sizes)


def frozen_bytes(layout: Layout) -> int:
    """Per-device bytes of the state's frozen part in its stored form (a LoRA base; 0 without one)."""
    if layout.frozen_abstract is None:
        return 0
    return per_device(layout.frozen_abstract, layout.frozen_specs, layout.mesh_sizes, in_bytes=True)


def state_elems(layout: Layout, specs, part: str | None = None) -> int:
    """Per-device elements of the params tree (or its `part` subtree), sharded by `specs`."""
    params = layout.abstract_params if part is None else layout.abstract_params[part]
    return per_device(params, specs if part is None else specs[part], layout.mesh_sizes)


def state_bytes(layout: Layout, specs, dtype, part: str | None = None) -> int:
    return state_elems(layout, specs, part) * itemsize(dtype)


def plain_grad_bytes(cfg: Config, layout: Layout, prec: Precision, *, rest_only: bool = False) -> int:
    """Gradient bytes per device of the default step: the projection weights' at the params' dtype where
    their gradient is a widened one (jaxmem.core.grad_dtype), every other leaf's at grad_reduce_dtype
    (`rest_only`: the embedding, final norm and LM head only)."""
    flat = jax.tree_util.tree_flatten_with_path(layout.abstract_params)[0]
    total = 0
    for (path, x), spec in zip(flat, spec_leaves(layout.grad_specs), strict=True):
        name = str(getattr(path[-1], "key", path[-1]))
        if rest_only and str(getattr(path[0], "key", path[0])) == "layers":
            continue
        if len(path) == 1 and name == "embed" and embed_grad.applies(cfg, layout, prec):
            # its touched rows (jaxmem.core.embed_grad): fp32 sums per distinct token, the rows' gradient
            total += embed_grad.rows_bytes(cfg, layout, prec)
            continue
        dtype = planned_dtype(name, cfg, prec, sp=layout.mesh_sizes["sp"])
        total += shard_elems(x.shape, spec, layout.mesh_sizes) * itemsize(dtype)
    return total


def rest_leaf_elems(layout: Layout) -> list[int]:
    """Elements per device of each non-layer leaf (embedding, final norm, LM head) as the optimizer state
    shards it, largest first: a streamed update moves them whole, one at a time."""
    rest, _ = split_layers(layout.abstract_params)
    rest_specs, _ = split_layers(layout.opt_specs)
    return sorted((shard_elems(x.shape, s, layout.mesh_sizes)
                   for x, s in zip(jax.tree.leaves(rest), spec_leaves(rest_specs), strict=True)), reverse=True)


def streamed_rest_elems(layout: Layout) -> list[int]:
    """rest_leaf_elems as a streamed update moves them: a piece at a time where it cuts them
    (Layout.rest_pieces), each piece then a leaf's count-th."""
    chunks = layout.rest_pieces
    count = chunks[1] if chunks else 1
    return [elems // count for elems in rest_leaf_elems(layout)]


def state_elem_bytes(layout: Layout, prec: Precision) -> list:
    """Bytes per weight value of the optimizer state kept with it, one entry per part: the fp32 master (if
    any), then the first and second moment (jaxmem.optim.kind.StateKind.moment_bytes_per_value: a float
    moment's itemsize, a quantized one's code bits and its block's scale, Adafactor's factored ~0)."""
    return ([4] if prec.master else []) + list(layout.optimizer.moment_bytes_per_value())


def abstract_train_state(cfg: Config, layout: Layout, prec: Precision) -> dict:
    """The train state the program assembles around the layout's trainable params (ShapeDtypeStructs)."""
    return jax.eval_shape(lambda p: assemble_state(cfg, prec, make_optimizer(cfg), p), layout.abstract_params)


def opt_state_bytes(layout: Layout, abstract_state: dict) -> tuple[int, int]:
    """Per-device bytes of the optimizer state's first- and second-moment leaves, from the state as the program
    builds it (`abstract_train_state`) sharded as the program shards it (jaxmem.optim.specs): float moments at
    their dtype, quantized ones as uint8 codes + fp32 block scales (fp32 under the threshold), Adafactor's
    factored rows and columns (its second moment; it keeps no first). The step counts are counter bytes."""
    opt = abstract_state["opt"]
    specs = layerwise_state_specs(opt, layout.abstract_params, layout.opt_specs, layout.mesh_sizes)
    first = second = 0
    for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(opt)[0], spec_leaves(specs), strict=True):
        if not is_state_value(x):
            continue
        size = shard_elems(x.shape, spec, layout.mesh_sizes) * itemsize(x.dtype)
        if "mu" in (getattr(k, "name", None) for k in path):
            first += size
        else:
            second += size
    return first, second


def is_state_value(x) -> bool:
    """A value of the optimizer state (a float moment, a quantized one's uint8 codes), not a step count."""
    return jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.uint8


def scheduler_limit(device: dict[str, int], device_memory: int) -> float:
    """XLA's GPU scheduler memory limit for this step (SCHEDULER_*): the device's share less the arguments."""
    args = device["params"] + device["base"] + device["inputs"]
    return (SCHEDULER_MEMORY_FRACTION * device_memory - args) * SCHEDULER_SLOP


def head_grad_itemsize(layout: Layout, prec: Precision) -> int:
    """Bytes per element of the LM head's whole gradient in the loss's backward. A fused loss (chunked, Pallas)
    writes dW in the dtype the head is used in, the compute dtype: with weights stored in that dtype it stays
    so (benchmarks/constants.md, accounting). The plain-XLA loss's dot with the fp32 logits gradient makes it
    fp32, as does the cast back to wider stored weights."""
    cd, param = itemsize(prec.compute), itemsize(prec.param)
    return cd if layout.kernels["loss"] != "naive" and param == cd else 4


def update_phase_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int],
                       device_memory: int) -> int:
    """Device bytes at the peak of an optimizer update streamed from the host (state on the host, update on
    the device). The non-layer leaves (embedding, LM head, final norm) are updated whole, or a piece at a time
    with the layers' weights on the host too (_streamed_rest_elems). At the largest one's update the device
    holds its fp32 master, m and v brought in, their three updated copies, its new bf16 weight, and every
    gradient not yet consumed (its own, the embedding's); activations, the layer phase and the old weights are
    dead. XLA's scheduler also prefetches the next leaf's state while that fits under its memory limit
    (`SCHEDULER_*`): a large device takes all three copies, a small one none (how this was read off compiles:
    benchmarks/constants.md, accounting)."""
    leaves = streamed_rest_elems(layout)
    largest = leaves[0] if leaves else 0
    state = [int(largest * b) for b in state_elem_bytes(layout, prec)]
    # in pieces the new weights are written over the old ones, which stay live through the loop (optim.
    # _rest_in_chunks; explain shows them at the peak, with the gradients, a piece's state in and out and the
    # next piece's state prefetched: benchmarks/constants.md, accounting)
    weights = device["params"] if layout.rest_pieces else largest * itemsize(prec.param)
    peak = device["grads"] + weights + 2 * sum(state)
    limit = scheduler_limit(device, device_memory)
    for copy in ([int(leaves[1] * b) for b in state_elem_bytes(layout, prec)] if len(leaves) > 1 else []):
        if peak + copy > limit:
            break
        peak += copy
    return peak


def quantized_layer_update_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int]) -> int:
    """Device bytes at one decoder layer's update with block-quantized moments streamed from the host (state on
    the host, update on the device): the non-layer weights and gradients still on the device, the buffer their
    new values are written into a piece at a time (Layout.rest_pieces), and one layer's fetched codes and
    weights, its new weights and the fp32 m and v its largest leaves are requantized from (two leaves in flight).
    Read off `jaxmem explain` of configs/llama3-8b-1x4090-8bit.yaml (deviceless): the bf16 embedding and LM head
    with their gradients and new buffers, then the layer's u8 codes, bf16 weights and two fp32 [4096, 14336]."""
    _, layer_params = split_layers(layout.abstract_params)
    _, layer_specs = split_layers(layout.opt_specs)
    leaves = sorted((shard_elems(x.shape, sp, layout.mesh_sizes) // cfg.model.n_layers
                     for x, sp in zip(jax.tree.leaves(layer_params), spec_leaves(layer_specs), strict=True)),
                    reverse=True)
    layer = sum(leaves)
    fetched = layer * (sum(state_elem_bytes(layout, prec)) + 2 * itemsize(prec.param))
    rest = device["params"] + device["grads"] + (device["params"] if layout.rest_pieces else 0)
    return int(rest + fetched + 2 * leaves[0] * 4)

