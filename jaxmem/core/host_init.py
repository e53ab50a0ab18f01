"""A step-0 train state whose pinned-host layer stacks are filled a layer at a time.

Built as one program, a fresh state's host-resident parts (master, Adam's m and v, offloaded layer params)
are made on the GPU whole and copied out, so init could need more device memory than the step it starts
(benchmarks/constants.md, host_init). Here those stacks start as host zeros made outside any program, are
donated, and a loop over the layers writes each layer's slice in place (optim.put_layer): the device holds
one layer's worth. The host leaves outside the layer stack (the embedding's and LM head's master, m and v)
are filled the same way in pieces of at most CHUNK_BYTES, as a large vocabulary's table alone, built whole,
would take more than a step. The values are the plain assembly's, bit for bit.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.core.offload import DEVICE
from jaxmem.optim.layerwise import CHUNK_BYTES, chunking, put_layer, put_slice, take_layer
from jaxmem.core.step_state import assemble_state
from jaxmem.runtime.memory_kinds_shim import is_host
from jaxmem.model.transformer import init_layer, init_model, layer_keys


def applies(prog) -> bool:
    """Whether the program's fresh state is built here: its plug-in assembles the state from the model's params
    (not LoRA's frozen base) and some layer stack lives in pinned host memory."""
    return prog.plugin.assembles_state and bool(host_layer_paths(prog))


def host_paths(prog, from_params: bool = False) -> list:
    """Key paths of the state's arrays that live in pinned host memory (empty: nothing to do). from_params: the
    params' own are not among them (the loaded ones, already in place, become the state's)."""
    flat = jax.tree_util.tree_flatten_with_path(prog.state_shardings)[0]
    return [path for path, sharding in flat if is_host(sharding)
            and not (from_params and _key(path[0]) == "params")]


def host_layer_paths(prog, from_params: bool = False) -> list:
    """The host_paths in the layer stacks (filled a layer at a time)."""
    return [path for path in host_paths(prog, from_params) if _in_layers(path)]


def _key(entry):
    return getattr(entry, "key", None)


def _in_layers(path) -> bool:
    return any(_key(k) == "layers" for k in path)


def _zeros(abstract, sharding):
    """Zeros of `abstract`'s shape and dtype on `sharding`, made shard by shard on the host (no program)."""
    def shard(index):
        shape = tuple(len(range(*s.indices(n))) for s, n in zip(index, abstract.shape))
        return np.zeros(shape, abstract.dtype)

    return jax.make_array_from_callback(abstract.shape, sharding, shard)


def fresh_state(prog, params=None, seed: int | None = None) -> dict:
    """The program's step-0 state, its host layer stacks filled layer by layer: from `params` (the model's,
    donated: a loaded checkpoint) or else initialized from `seed` as init_model would."""
    zeros = [_zeros(a, s) for a, s in _host_stacks(prog, params is not None)]
    return init_program(prog, params is not None, seed)(zeros, params)


def lower(prog, from_params: bool = False):
    """The init program lowered on abstract inputs (a plan's or a test's compile)."""
    zeros = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in _host_stacks(prog, from_params)]
    with prog.lowering():
        return init_program(prog, from_params).lower(zeros, loading_targets(prog) if from_params else None)


def loading_targets(prog) -> dict:
    """The model's abstract params placed where the state keeps them: a loaded checkpoint's layers land in
    host memory directly where offload.params=host, never whole on the device."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        prog.abstract_model_params(), prog.state_shardings["params"])


def _host_stacks(prog, from_params: bool) -> list:
    """(abstract value, sharding) of each leaf of host_paths, in its order."""
    abstract, shardings = _by_path(prog.abstract_state), _by_path(prog.state_shardings)
    return [(abstract[p], shardings[p]) for p in host_paths(prog, from_params)]


def _nested(path, leaf) -> dict:
    """A params tree holding only `leaf` at `path` (DictKeys)."""
    for entry in reversed(path):
        leaf = {_key(entry): leaf}
    return leaf


def _rest_plan(prog, paths) -> dict:
    """Each non-layer params leaf with host state built from it (its master, m, v, ...) -> (those state paths,
    the axis it is built along in pieces, a piece's length, how many: optim.chunking under CHUNK_BYTES)."""
    cfg, prec, opt = prog.cfg, prog.precision, prog.optimizer
    shardings = _by_path(prog.state_shardings)
    plan = {}
    for q, leaf in jax.tree_util.tree_flatten_with_path({k: v for k, v in prog.abstract_model_params().items()
                                                         if k != "layers"})[0]:
        derived = _by_path(jax.eval_shape(lambda x, q=q: assemble_state(cfg, prec, opt, _nested(q, x)), leaf))
        targets = [p for p in paths if p in derived and not _in_layers(p)]
        if not targets:
            continue
        sharding = shardings[targets[0]]
        shards = math.prod(leaf.shape) // math.prod(sharding.shard_shape(leaf.shape))
        axis, count = chunking(leaf.shape, sharding.spec, CHUNK_BYTES, shards)
        plan[q] = (targets, axis, leaf.shape[axis] // count, count)
    return plan


def _by_path(tree) -> dict:
    return dict(jax.tree_util.tree_flatten_with_path(tree)[0])


def init_program(prog, from_params: bool, seed: int | None = None):
    """jit of (host zeros of host_paths, the model's params or None) -> the step-0 state."""
    from flax import nnx

    cfg, prec, opt = prog.cfg, prog.precision, prog.optimizer
    paths = host_paths(prog, from_params)
    layer_paths = [p for p in paths if _in_layers(p)]
    assemble = lambda params: _by_path(assemble_state(cfg, prec, opt, params))  # noqa: E731
    rest = _rest_plan(prog, paths)
    seed = cfg.train.seed if seed is None else seed

    def build(zeros, params):
        if params is None:
            whole = nnx.to_pure_dict(nnx.split(init_model(cfg.model, seed=seed, param_dtype=prec.param))[1])
            keys = layer_keys(cfg.model, seed)
            layer_of = lambda key: init_layer(cfg.model, key, param_dtype=prec.param)  # noqa: E731
            # the stack for the state's device-resident layer leaves (unused, so never computed, where all are
            # on the host); the loop below initializes each host layer again rather than read it from here,
            # which would hold the whole stack on the device
            params = dict({k: v for k, v in whole.items() if k != "layers"}, layers=jax.lax.map(layer_of, keys))
            layer_at = lambda i: layer_of(keys[i])  # noqa: E731
        else:
            layer_at = lambda i: jax.tree.map(lambda x: jax.device_put(x, DEVICE),  # noqa: E731
                                              take_layer(params["layers"], i))
        state = assemble_state(cfg, prec, opt, params)

        by_path = dict(zip(paths, zeros, strict=True))

        def body(carry, i):
            sliced = assemble({"layers": jax.tree.map(lambda x: x[None], layer_at(i))})
            return [put_layer(c, sliced[p][0], i) for c, p in zip(carry, layer_paths, strict=True)], None

        filled, _ = jax.lax.scan(body, [by_path[p] for p in layer_paths], jnp.arange(cfg.model.n_layers))
        by_path.update(zip(layer_paths, filled, strict=True))
        params_at, state_at = _by_path(params), _by_path(state)
        for q, (targets, axis, size, count) in rest.items():
            if count == 1:  # small, or split over every axis: built whole, as the state has it
                by_path.update((p, state_at[p]) for p in targets)
                continue
            param = jax.device_put(params_at[q], DEVICE)

            def chunk_body(carry, i, q=q, param=param, axis=axis, size=size, targets=targets):
                sliced = assemble(_nested(q, jax.lax.dynamic_slice_in_dim(param, i * size, size, axis)))
                return [put_slice(c, sliced[p], i * size, axis) for c, p in zip(carry, targets, strict=True)], None

            filled, _ = jax.lax.scan(chunk_body, [by_path[p] for p in targets], jnp.arange(count))
            by_path.update(zip(targets, filled, strict=True))
        return jax.tree_util.tree_map_with_path(lambda p, x: by_path.get(p, x), state)

    donate = (0, 1) if from_params and prog.plugin.donates_params else (0,)
    return jax.jit(build, out_shardings=prog.state_shardings, donate_argnums=donate)
