"""Partition specs of an optimizer state from its params' specs: low-bit AdamW, optax's Adam and Adafactor.

A state leaf inside a params-shaped subtree (Adam's mu and nu, Adafactor's v_row, v_col and v) follows its
param's spec: the same spec where it has the param's shape; the spec without the reduced dim where it has one
dim fewer (Adafactor's factored rows and columns); replicated otherwise (Adafactor's (1,) placeholders). A
`codes.QTensor` gives its codes the param's spec, and its scales the param's spec too where the blocks fall
inside the shards of the last dim (else the scales are replicated along it: they are 4 bytes per block, and
XLA combines the maxima of a block that spans devices). Every other leaf (counts) gets `non_param_spec`.
"""
from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jaxmem.mesh.sharding import spec_ways
from jaxmem.optim import codes


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _entries(spec: P, ndim: int) -> list:
    entries = list(spec) + [None] * (ndim - len(spec))
    return entries[:ndim]


def quantized_specs(q: codes.QTensor, spec: P, mesh_sizes: dict) -> codes.QTensor:
    """The specs of a QTensor's codes and scales for a param of `spec` (the module's rule above)."""
    entries = _entries(spec, len(q.shape))
    ways = spec_ways(P(entries[-1]), mesh_sizes) if entries else 1
    shard = q.last // ways if q.last % ways == 0 else 0
    bits = codes.CODES[q.code].bits
    codes_last = entries[-1] if shard and (bits == 8 or shard % 2 == 0) else None
    scales_last = entries[-1] if shard and shard % q.block == 0 else None
    return dataclasses.replace(q, codes=P(*entries[:-1], codes_last), scales=P(*entries[:-1], scales_last))


def _array_spec(leaf, param, spec: P) -> P:
    shape, ref = tuple(leaf.shape), tuple(param.shape)
    entries = _entries(spec, len(ref))
    if shape == ref:
        return P(*entries)
    if len(shape) == len(ref) - 1:  # one dim reduced: the last candidate, so a layer stack's dim 0 loses ties
        for dim in reversed(range(len(ref))):
            if ref[:dim] + ref[dim + 1:] == shape:
                return P(*(entries[:dim] + entries[dim + 1:]))
    return P()


def map_param_subtrees(state, params_def, on_params, on_other):
    """`state` (an optimizer's state) rebuilt: each subtree shaped like the params (treedef `params_def`,
    QTensors as leaves) becomes on_params(subtree), each other node that is not a container on_other(node);
    namedtuples, tuples, lists and dicts are walked into, None kept."""
    def walk(node):
        if node is None:
            return None
        if jax.tree.structure(node, is_leaf=codes.is_quantized) == params_def:
            return on_params(node)
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            return type(node)(*(walk(x) for x in node))
        if isinstance(node, (tuple, list)):
            return type(node)(walk(x) for x in node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return on_other(node)

    return walk(state)


def state_specs(abstract_state, abstract_params, param_specs, mesh_sizes: dict, non_param_spec=P()):
    """Specs of `abstract_state` (one optimizer's state of `abstract_params`, whose specs are `param_specs`;
    `mesh_sizes`: devices per mesh axis name). Shaped like the state, QTensors holding their parts' specs."""
    params_def = jax.tree.structure(abstract_params)

    def leaf_spec(spec, param, leaf):
        if codes.is_quantized(leaf):
            return quantized_specs(leaf, spec, mesh_sizes)
        return _array_spec(leaf, param, spec)

    return map_param_subtrees(
        abstract_state, params_def,
        lambda node: jax.tree.map(leaf_spec, param_specs, abstract_params, node, is_leaf=_is_spec),
        lambda node: non_param_spec)


def layerwise_state_specs(abstract_opt: dict, abstract_weights: dict, weight_specs: dict, mesh_sizes: dict,
                          non_param_spec=P()) -> dict:
    """`state_specs` of the layer-wise state {"rest": ..., "layers": ...} (jaxmem.optim.layerwise.init_opt_state)
    of `abstract_weights` (the layer stack stacked along dim 0)."""
    def part(tree, key):
        return tree[key] if key == "layers" else {k: v for k, v in tree.items() if k != "layers"}

    return {key: state_specs(abstract_opt[key], part(abstract_weights, key), part(weight_specs, key), mesh_sizes,
                             non_param_spec) for key in abstract_opt}
