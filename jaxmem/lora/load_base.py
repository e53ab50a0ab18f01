"""A LoRA run's frozen base streamed from a Hugging Face checkpoint directory (or a `jaxmem import-hf`
output), quantized on the host.

`checkpoint.init_from` naming a Hugging Face directory (config.json + *.safetensors, the download itself) in a
LoRA run builds the base here instead of materializing the model: every stacked weight is read a layer at a
time (one HF tensor in the parameter dtype, at most one layer's weight in fp32 while it is quantized),
brought to its stored form on the host (jaxmem.lora.quant_host, bit-identical to jaxmem.lora.frozen.store)
and written into its slot of the [L, ...] leaf, already in its target sharding, on the device. So neither
the host nor the device ever holds the whole base in the parameter dtype: a 70B QLoRA run starts on one GPU.
The embedding, final norm and LM head are read like jaxmem.io.hf.load_hf reads them (slices per device).
A `jaxmem import-hf` output is read the same way, a layer at a time, through tensorstore (_ImportedSource).
"""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxmem.io.hf import _callback, _get, _set
from jaxmem.io.hf_check import check_tensors
from jaxmem.io.hf_config import read_json_object
from jaxmem.io.hf_layout import param_maps, read_slice
from jaxmem.io.hf_mxfp4 import checkpoint_reader
from jaxmem.io.hf_safetensors import CheckpointReader
from jaxmem.lora import quant_host
from jaxmem.lora.adapters import target_weights
from jaxmem.lora.frozen import NF4_BLOCK, LoraSetup
from jaxmem.config.schema import Config, ConfigError
from jaxmem.io.model_match import check_hf_config, check_model_json, is_hf_dir, is_imported_dir
from jaxmem.lora.frozen_vocab import store_table

KEY = "checkpoint.init_from"


def store_layer(setup: LoraSetup, cfg: Config, name: str, w: np.ndarray):
    """One layer of a frozen linear (numpy, the parameter dtype) in its stored form, as frozen.store (the
    experts' [E, ...] weight: int8 per expert, then stacked; nf4 flattened whole, as on the device)."""
    if setup.base_dtype == "int8":
        weight = target_weights(cfg.model)[name]
        ins = tuple(range(len(weight.in_shape)))
        if weight.lead_shape:
            per_expert = [quant_host.quantize_int8(w[e], ins) for e in range(w.shape[0])]
            return {k: np.stack([q[k] for q in per_expert]) for k in per_expert[0]}
        return quant_host.quantize_int8(w, ins)
    if setup.base_dtype == "nf4":
        return quant_host.quantize_nf4(w, NF4_BLOCK, setup.double_quant)
    return w.astype(jnp.dtype(setup.base_dtype))


def read_layer(reader: CheckpointReader, pm, layer: int, layer_shape: tuple[int, ...]) -> np.ndarray:
    """Layer `layer` of the stacked param `pm`, whole, in our layout (the HF tensor's dtype); a mixture's expert
    param (one HF tensor per expert) stacked over its experts."""
    if pm.lead == 2:
        return np.stack([_read_tensor(reader, pm, pm.name_at((layer, e)), layer_shape[1:])
                         for e in range(layer_shape[0])])
    return _read_tensor(reader, pm, pm.hf_name.format(layer=layer), layer_shape)


def _read_tensor(reader: CheckpointReader, pm, name: str, layer_shape: tuple[int, ...]) -> np.ndarray:
    block = read_slice(pm.kind, lambda hf_index: reader.read(name, hf_index), (slice(None),) * len(layer_shape),
                       layer_shape)
    if not np.isfinite(block).all():
        raise ConfigError(f"{reader.file_of(name)}: tensor {name} holds inf/NaN values; the file is damaged")
    return block


def _layer_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer's [1, ...] slot: the leaf's, with the layer dim whole."""
    return NamedSharding(sharding.mesh, P(None, *tuple(sharding.spec)[1:]), memory_kind=sharding.memory_kind)


def _writer(sharding: NamedSharding):
    """put(buffer, piece, layer): the buffer (donated) with the host numpy `piece` as its layer `layer`."""
    one = _layer_sharding(sharding)
    update = jax.jit(lambda buf, piece, i: jax.lax.dynamic_update_slice_in_dim(buf, piece, i, 0),
                     out_shardings=sharding, donate_argnums=0)

    def put(buf, piece: np.ndarray, layer: int):
        piece = np.asarray(piece, buf.dtype)[None]
        slot = jax.make_array_from_callback(piece.shape, one, lambda index: piece[index])
        return update(buf, slot, jnp.int32(layer))

    return put


class _HfSource:
    """Tensors of a Hugging Face directory (safetensors shards)."""

    def __init__(self, path: Path, cfg: Config, maps, abstract):
        check_hf_config(path, cfg)
        self.reader = checkpoint_reader(path, read_json_object(path / "config.json"))
        check_tensors(self.reader, maps, abstract, path, tied=cfg.model.tie_embeddings)

    def whole(self, pm, shape, sharding, np_dtype) -> jax.Array:
        return jax.make_array_from_callback(shape, sharding, _callback(self.reader, pm, shape, np_dtype))

    def layer(self, pm, layer: int, layer_shape) -> np.ndarray:
        return read_layer(self.reader, pm, layer, layer_shape)


class _ImportedSource:
    """Params of a `jaxmem import-hf` output (orbax, OCDBT), read through tensorstore a slice at a time: orbax
    stores each param as a zarr array named by its dotted path inside the OCDBT database (orbax 0.11-0.12)."""

    def __init__(self, path: Path, cfg: Config, maps, abstract):
        check_model_json(path, cfg)
        self.params = (path / "params").absolute()
        self.stores = {pm.path: self._open(pm, _get(abstract, pm.path).shape) for pm in maps}

    def _open(self, pm, shape):
        import tensorstore as ts

        name = ".".join(pm.path)
        spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{self.params}/", "path": f"{name}/"},
                "fill_missing_data_reads": False}
        try:
            store = ts.open(spec, open=True, read=True).result()
        except Exception as e:  # tensorstore: missing or unreadable array
            raise ConfigError(f"{KEY}: {self.params} has no readable {name} ({str(e).splitlines()[0][:160]}); run "
                              "`jaxmem import-hf` again, or name the Hugging Face directory") from None
        if tuple(store.shape) != tuple(shape):
            raise ConfigError(f"{KEY}: {self.params} holds {name} of shape {list(store.shape)}, the run's is "
                              f"{list(shape)}")
        return store

    def whole(self, pm, shape, sharding, np_dtype) -> jax.Array:
        store = self.stores[pm.path]
        return jax.make_array_from_callback(
            shape, sharding, lambda index: np.asarray(store[index].read().result()).astype(np_dtype))

    def layer(self, pm, layer: int, layer_shape) -> np.ndarray:
        block = np.asarray(self.stores[pm.path][layer].read().result())
        if not np.isfinite(block).all():
            raise ConfigError(f"{KEY}: {self.params} holds inf/NaN values in {'.'.join(pm.path)}; run "
                              "`jaxmem import-hf` again")
        return block


def streams(path: str | Path) -> bool:
    """`path` is a base stream_base reads a layer at a time: a Hugging Face directory or an import-hf output."""
    return is_hf_dir(path) or is_imported_dir(path)


def stream_base(prog, path: str | Path) -> dict:
    """The frozen base of `prog` (a LoRA TrainProgram) from the HF directory or `jaxmem import-hf` output
    `path`, in state_shardings["base"]."""
    path = Path(path)
    cfg, setup = prog.cfg, prog.layout.part("lora")
    maps = param_maps(cfg.model)
    abstract = prog.layout.model_abstract_params
    source = (_HfSource if is_hf_dir(path) else _ImportedSource)(path, cfg, maps, abstract)
    out, shapes = prog.state_shardings["base"], prog.abstract_state["base"]
    param_dtype = np.dtype(prog.precision.param)
    base: dict = {}
    for pm in maps:
        if not pm.stacked:
            shape = _get(abstract, pm.path).shape
            leaf_sharding = _get(out, pm.path)
            if not isinstance(leaf_sharding, NamedSharding):  # a quantized table: loaded like a param first
                leaf_sharding = _get(prog.abstract_model_params(), pm.path).sharding
            _set(base, pm.path, source.whole(pm, shape, leaf_sharding, param_dtype))
    _store_vocab(setup, base, out)
    stacked = [pm for pm in maps if pm.stacked]
    writers, buffers = {}, {}
    for pm in stacked:
        name = pm.path[1]
        writers[name] = jax.tree.map(_writer, out["layers"][name])
        buffers[name] = jax.tree.map(lambda a, s: jax.jit(lambda: jnp.zeros(a.shape, a.dtype), out_shardings=s)(),
                                     shapes["layers"][name], out["layers"][name])
    for layer in range(cfg.model.n_layers):
        for pm in stacked:
            name = pm.path[1]
            w = source.layer(pm, layer, _get(abstract, pm.path).shape[1:]).astype(param_dtype)
            stored = store_layer(setup, cfg, name, w) if name in setup.frozen else w
            del w
            buffers[name] = jax.tree.map(lambda put, buf, piece: put(buf, piece, layer), writers[name],
                                         buffers[name], stored)
    base["layers"] = buffers
    return base


def _store_vocab(setup: LoraSetup, base: dict, out: dict) -> None:
    """lora.quantize_embeddings: the embedding table and LM head stored per vocab row, as frozen.make_base
    stores them (on the device: one table at a time, never the layers)."""
    if not setup.quantize_embeddings:
        return
    for key in ("embed", "lm_head"):
        if key in base:
            base[key] = jax.jit(lambda w, key=key: store_table(setup, key, w), out_shardings=out[key])(base[key])
