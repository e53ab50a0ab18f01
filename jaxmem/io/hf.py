"""Hugging Face interop: stream a local checkpoint into sharded params, write one back, `jaxmem import-hf`."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from jaxmem.mesh import sharding
from jaxmem.config.schema import ConfigError, ParallelConfig
from jaxmem.io.hf_check import check_tensors
from jaxmem.io.hf_config import hf_config_from_model, model_config_from_hf, read_json_object
from jaxmem.io.hf_layout import ParamMap, hf_shape, merge_hf, param_maps, read_slice, to_hf
from jaxmem.io.hf_mxfp4 import checkpoint_reader
from jaxmem.io.hf_safetensors import INDEX_FILE, CheckpointReader, nbytes, plan_shards, write_shard
from jaxmem.model.transformer import Transformer, abstract_model

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
DEFAULT_SHARD_BYTES = 2 * 10**9


def _dtype_name(dtype) -> str:
    for name, np_dtype in DTYPES.items():
        if np.dtype(np_dtype) == np.dtype(dtype):
            return name
    raise ConfigError(f"dtype: {dtype} is not supported; use one of {', '.join(DTYPES)}")


def _get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _target_shardings(abstract_state, mesh: Mesh | None, parallel: ParallelConfig | None) -> dict:
    if mesh is None:
        one = SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: one, nnx.to_pure_dict(abstract_state))
    parallel = parallel or ParallelConfig()
    rules = sharding.RULE_TABLES[parallel.rules]
    if parallel.zero_stage < 3:  # same parameter placement as jaxmem.core.program for ZeRO-1/2
        rules = sharding.without_data_axes(rules)
    return sharding.named(mesh, sharding.param_specs(abstract_state, rules, mesh))


def _callback(reader: CheckpointReader, pm: ParamMap, shape: tuple[int, ...], np_dtype):
    """cb(index) for make_array_from_callback: builds only the requested slice, layer by layer."""

    def one(name: str, index: tuple, layer_shape: tuple[int, ...]) -> np.ndarray:
        block = read_slice(pm.kind, lambda hf_index: reader.read(name, hf_index), index, layer_shape)
        if not np.isfinite(block).all():  # no checksums in safetensors: garbage bytes often decode to inf/NaN
            raise ConfigError(f"{reader.file_of(name)}: tensor {name} holds inf/NaN values; the file is damaged")
        return block

    def cb(index):
        lead = pm.lead
        if not lead:
            return one(pm.hf_name, index, shape).astype(np_dtype)
        ranges = [range(*index[i].indices(shape[i])) for i in range(lead)]  # layers (, experts)
        parts = [one(pm.name_at(key), index[lead:], shape[lead:]).astype(np_dtype)
                 for key in itertools.product(*ranges)]
        return np.stack(parts).reshape(tuple(map(len, ranges)) + parts[0].shape)

    return cb


def load_hf(path, dtype: str = "float32", mesh: Mesh | None = None,
            parallel: ParallelConfig | None = None) -> Transformer:
    """Reads a local HF checkpoint (Llama, Mistral, Qwen2, Qwen3, Gemma 3 text, Qwen3-MoE, Mixtral) into a jaxmem
    Transformer.

    Args:
      path: directory with config.json and *.safetensors shards (with or without the index file).
      dtype: parameter dtype, one of float32, bfloat16, float16.
      mesh: place params with jaxmem.mesh.sharding.param_specs and the rules of `parallel`
        (default: fsdp rules, ZeRO-3); None puts them on one local device.
    Returns:
      The model; `model(tokens_bt)` gives fp32 logits [B, T, V]. Each parameter is built
      directly in its target sharding from the slices each device needs.
    """
    path = Path(path)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype: {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file}: not found; expected a Hugging Face checkpoint directory")
    cfg = model_config_from_hf(read_json_object(config_file), where=str(config_file))
    graphdef, state = nnx.split(abstract_model(cfg, param_dtype=jnp.dtype(DTYPES[dtype])))
    abstract = nnx.to_pure_dict(state)
    shardings = _target_shardings(state, mesh, parallel)
    targets = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    values = read_params(path, targets)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def read_params(path, targets: dict) -> dict:
    """The params of the Hugging Face directory `path` as arrays on `targets` (ShapeDtypeStructs with their
    shardings: the model's params tree): each device reads only its slices; config.json is checked against
    the shards first (one ConfigError line)."""
    path = Path(path)
    hf_cfg = read_json_object(path / "config.json")
    cfg = model_config_from_hf(hf_cfg, where=str(path / "config.json"))
    reader = checkpoint_reader(path, hf_cfg)
    maps = param_maps(cfg, hf_cfg["architectures"][0])
    check_tensors(reader, maps, targets, path, tied=cfg.tie_embeddings)  # config.json against the shards
    values: dict = {}
    for pm in maps:
        target = _get(targets, pm.path)
        cb = _callback(reader, pm, target.shape, np.dtype(target.dtype))
        _set(values, pm.path, jax.make_array_from_callback(target.shape, target.sharding, cb))
    return values


def _gather(x: jax.Array | np.ndarray) -> np.ndarray:
    if isinstance(x, np.ndarray) or x.is_fully_addressable:  # host arrays: a pipeline's merged model
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf(model: Transformer, path, *, architecture: str | None = None, dtype: str | None = None,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """Writes config.json and safetensors shards that transformers loads.

    Args:
      architecture: one of jaxmem.io.hf_registry.FAMILIES; default: the family whose options the model has
        (LlamaForCausalLM, Qwen2ForCausalLM with qkv bias, Qwen3ForCausalLM with q/k norms, Gemma3ForCausalLM,
        MixtralForCausalLM / Qwen3MoeForCausalLM for a mixture of experts).
      dtype: tensor dtype in the files (default: the params' dtype).
      max_shard_bytes: shard size; more than one shard adds model.safetensors.index.json.
    Returns the shard paths. Gathers one HF tensor (one layer of a stacked param) at a time.
    """
    cfg = model.cfg
    params = nnx.to_pure_dict(nnx.split(model)[1])
    out_dtype = np.dtype(DTYPES[dtype] if dtype else _get(params, ("embed",)).dtype)
    hf_cfg = hf_config_from_model(cfg, _dtype_name(out_dtype), architecture)  # refuses a family that lacks cfg
    maps = param_maps(cfg, hf_cfg["architectures"][0])
    # Tensor order as transformers writes it: embedding, layer by layer, final norm, head.
    order = [(pm, ()) for pm in maps if not pm.stacked and pm.path != ("final_norm",) and pm.path != ("lm_head",)]
    order += [(pm, key) for i in range(cfg.n_layers) for pm in maps if pm.stacked
              for key in pm.keys(_get(params, pm.path).shape) if key[0] == i]  # (layer,) or (layer, expert)
    order += [(pm, ()) for pm in maps if pm.path in (("final_norm",), ("lm_head",))]
    source: dict[str, list] = {}  # HF name -> the (map, key) of each parameter it holds (gpt-oss: gate + up)
    entries = []
    for pm, key in order:
        shape = _get(params, pm.path).shape
        name = pm.name_at(key)
        if name not in source:
            entries.append((name, hf_shape(pm.kind, shape[pm.lead:]), out_dtype))
        source.setdefault(name, []).append((pm, key))

    def produce(name: str) -> np.ndarray:
        parts = []
        for pm, key in source[name]:
            x = _get(params, pm.path)
            parts.append(to_hf(pm.kind, _gather(x[key] if key else x)))
        return merge_hf(parts)

    path = Path(path)
    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(entries, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file_name, shard in zip(names, shards):
        write_shard(path / file_name if writer else None, shard, produce)
    if writer:
        if len(shards) > 1:
            weight_map = {name: file_name for file_name, shard in zip(names, shards) for name, _, _ in shard}
            total = sum(nbytes(shape, dt) for _, shape, dt in entries)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (path / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    return [path / n for n in names]
