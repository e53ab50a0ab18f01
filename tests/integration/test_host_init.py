"""jaxmem.core.host_init: a fresh state's pinned-host layer stacks are filled a layer at a time, with the plain
assembly's values, and the init's device bytes do not grow with the layers."""
import jax
import numpy as np
import pytest

from jaxmem.loader import load_config
from jaxmem.core import host_init
from jaxmem.registry import build_program

TINY = ["model.preset=tiny", "model.n_layers=3", "train.seq_len=16", "train.micro_batch=2", "parallel.fsdp=2",
        "precision.param_dtype=bfloat16", "precision.master_weights=true", "remat.preset=full"]
HOST = ["offload.optimizer=host", "offload.params=host"]


def _plain(prog, params=None):
    """The state as one program builds it (the path host_init replaces)."""
    if params is None:
        return jax.jit(lambda: prog._fresh_state(prog.cfg.train.seed), out_shardings=prog.state_shardings)()
    return jax.jit(prog.state_from_params, out_shardings=prog.state_shardings)(params)


def _assert_same(a, b):
    paths_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    paths_b, tree_b = jax.tree_util.tree_flatten_with_path(b)
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(paths_a, paths_b, strict=True):
        assert x.dtype == y.dtype and x.sharding.memory_kind == y.sharding.memory_kind, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize("offload,chunk_bytes", [(HOST, None), (["offload.optimizer=host"], 4096)],
                         ids=["params_and_optimizer", "optimizer_rest_in_chunks"])
def test_seeded_and_loaded_states_equal_the_plain_assembly(offload, chunk_bytes, monkeypatch):
    if chunk_bytes:  # the embedding's and LM head's host state built in chunks (as at full size), not whole
        monkeypatch.setattr(host_init, "CHUNK_BYTES", chunk_bytes)
    prog = build_program(load_config(None, TINY + offload), devices=jax.devices()[:2])
    paths = host_init.host_layer_paths(prog)
    assert host_init.applies(prog) and paths and all(jax.tree_util.keystr(p).startswith(("['params']", "['master']", "['opt']")) for p in paths)
    chunked = {jax.tree_util.keystr(q): count for q, (_, _, _, count) in host_init._rest_plan(
        prog, host_init.host_paths(prog)).items()}
    assert chunked["['embed']"] == (16 if chunk_bytes else 1), chunked  # [vocab, d] split over fsdp: along d
    seeded = prog.init_state()  # host_init's path: host layer stacks present
    _assert_same(seeded, _plain(prog))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(seeded["master"]["layers"])}
    assert kinds == {"pinned_host"}
    # from loaded params (checkpoint.init_whole): the layers placed where the state keeps them
    params = jax.device_put(prog.fresh_params(7), jax.tree.map(lambda a: a.sharding, host_init.loading_targets(prog)))
    expected = _plain(prog, jax.tree.map(lambda x: x.copy(), params))
    _assert_same(host_init.fresh_state(prog, params), expected)


def test_all_device_state_keeps_the_plain_path():
    prog = build_program(load_config(None, TINY), devices=jax.devices()[:2])
    assert host_init.host_layer_paths(prog) == [] and not host_init.applies(prog)


@pytest.mark.slow
def test_deviceless_init_device_bytes_do_not_grow_with_layers():
    """configs/llama3-8b-1x4090.yaml (optimizer and params on the host, one RTX 4090, deviceless): the plain init
    made the host state on the device and copied it out (22.96 GiB at 32 layers, over the card, against a 14.68
    GiB step); host_init's holds one layer's at a time, and the embedding's and LM head's master, m and v in
    chunks: the same bytes for 2 and 32 layers (3.32 GiB), and from loaded params within one layer weight
    (3.35)."""
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime import aot
    from jaxmem.runtime.compiled_memory import memory_figures

    def program(n_layers):
        cfg = load_config("configs/llama3-8b-1x4090.yaml", [f"model.n_layers={n_layers}"])
        return build_program(cfg, devices=aot.target_devices(cfg.target.name, 1))

    compiled = {}  # by the lowered text: the plan's init is host_init's program, compiled once

    def device(lowered):
        text = lowered.as_text()
        if text not in compiled:
            compiled[text] = memory_figures(lowered.compile())["device"]
        return compiled[text]

    two, whole = program(2), program(32)
    lean = device(host_init.lower(whole))
    assert device(whole.lower_init()) == lean  # what a plan compiles as the run's init
    assert abs(device(host_init.lower(two)) - lean) < 2**20  # a few scalars apart
    assert abs(device(host_init.lower(whole, from_params=True)) - lean) < 2**26  # a [4096, 4096] bf16 weight
    with whole.lowering():
        plain = device(jax.jit(lambda: whole._fresh_state(0), out_shardings=whole.state_shardings).lower())
    params = whole.abstract_state["params"]
    layer_weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"]))
    assert plain > lean + layer_weights, (plain, lean, layer_weights)  # more than every layer's bf16 weights
    # what stays: the device params (embedding, LM head), one layer's bf16 weights and fp32 master, one chunk
    device_params = sum(x.size * x.dtype.itemsize for k, v in params.items() if k != "layers"
                        for x in jax.tree.leaves(v))
    bound = device_params + layer_weights // 32 * 3 + host_init.CHUNK_BYTES
    assert lean < bound, (lean, bound)  # built whole, the embedding's and LM head's fp32 state: 3.91 GiB
