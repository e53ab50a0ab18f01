"""The "stages" item of a pipeline checkpoint: each stage's train state, written by the processes that
drive it.

Why not orbax's standard item: in a run of several processes, a stage that lives inside one process has
arrays that process alone can address, and orbax (like jax.experimental.array_serialization) refuses to
write such arrays when there are other processes. This item writes every array as a zarr3 store with
tensorstore: each process writes the shards it holds (replica 0 only), chunked as the saving sharding
shards it, one leaf at a time (host memory for one leaf's local shards, not the whole state). The lead
process of each stage writes `stage_<s>/shapes.json`, which a restore checks before reading anything.
orbax's manager around it still owns the step directory: temporary until every process has written,
then renamed, so a half-written step is never the latest.

A restore reads each leaf onto whatever sharding the caller asks for (the same stage layout, another
one, or the host for a re-cut), in the caller's dtype; stages this process does not drive come back as
None, as the pipeline's state holds them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxmem.core.step_state import leaf_name

SHAPES = "shapes.json"


def _drives(sharding) -> bool:
    me = jax.process_index()
    return any(d.process_index == me for d in sharding.device_set)


def _leads(sharding) -> bool:
    return jax.process_index() == min(d.process_index for d in sharding.device_set)


def _store(directory: Path, name: str) -> dict:
    # Every chunk is written, zeros included, and a missing chunk is an error on read, not zeros.
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(directory / name)},
            "store_data_equal_to_fill_value": True, "fill_missing_data_reads": False}


def _write_leaf(directory: Path, name: str, arr: jax.Array) -> None:
    chunk = arr.sharding.shard_shape(arr.shape)
    store = ts.open(_store(directory, name), create=True, open=True, dtype=ts.dtype(arr.dtype.name),
                    shape=arr.shape, chunk_layout=ts.ChunkLayout(write_chunk_shape=chunk)).result()
    for shard in arr.addressable_shards:
        if shard.replica_id == 0:
            store[shard.index].write(np.asarray(jax.device_get(shard.data))).result()


def _read_leaf(directory: Path, name: str, want) -> jax.Array:
    store = ts.open(_store(directory, name), open=True).result()
    if tuple(store.shape) != tuple(want.shape):
        raise ValueError(f"{name} has shape {list(store.shape)}, expected {list(want.shape)}")
    return jax.make_array_from_callback(
        want.shape, want.sharding, lambda index: np.asarray(store[index].read().result()).astype(want.dtype))


def saved_shapes(directory: Path) -> dict[str, tuple]:
    """'stages.<s>.<leaf>' -> shape of every leaf of every stage, from the shapes files only."""
    shapes = {}
    stage_dirs = sorted(directory.glob("stage_*"), key=lambda p: int(p.name.split("_")[1]))
    if not stage_dirs:
        raise FileNotFoundError(f"no stage_* directories in {directory}")
    for stage_dir in stage_dirs:
        s = stage_dir.name.split("_")[1]
        saved = json.loads((stage_dir / SHAPES).read_text())
        shapes.update({f"stages.{s}.{k}": tuple(v) for k, v in saved.items()})
    return shapes


class StagesHandler(ocp.CheckpointHandler):
    """Saves / restores a list of stage states (None for a stage this process does not drive)."""

    def save(self, directory, args: "StagesSave") -> None:
        directory = Path(directory)
        for s, tree in enumerate(args.stages):
            if tree is None:
                continue
            stage_dir = directory / f"stage_{s}"
            leaves = jax.tree_util.tree_leaves_with_path(tree)
            if leaves and _leads(leaves[0][1].sharding):
                stage_dir.mkdir(parents=True, exist_ok=True)
                (stage_dir / SHAPES).write_text(json.dumps({leaf_name(p): list(a.shape) for p, a in leaves}))
            for path, arr in leaves:
                _write_leaf(stage_dir, leaf_name(path), arr)

    def restore(self, directory, args: "StagesRestore") -> list:
        directory = Path(directory)
        out = []
        for s, abstract in enumerate(args.stages):
            leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
            if not leaves or not _drives(leaves[0][1].sharding):
                out.append(None)
                continue
            stage_dir = directory / f"stage_{s}"
            out.append(jax.tree_util.tree_unflatten(
                treedef, [_read_leaf(stage_dir, leaf_name(p), want) for p, want in leaves]))
        return out


@ocp.args.register_with_handler(StagesHandler, for_save=True)
@dataclasses.dataclass
class StagesSave(ocp.args.CheckpointArgs):
    stages: list


@ocp.args.register_with_handler(StagesHandler, for_restore=True)
@dataclasses.dataclass
class StagesRestore(ocp.args.CheckpointArgs):
    stages: list  # ShapeDtypeStructs with shardings, one tree per stage


class StagesItem:
    """A pipeline's train state {"stages": [...]} as the "stages" item (jaxmem.core.plugins.StateItem)."""

    name = "stages"

    def save_args(self, state: dict) -> StagesSave:
        return StagesSave(state["stages"])

    def restore_args(self, abstract_state: dict) -> StagesRestore:
        return StagesRestore(abstract_state["stages"])

    def saved_shapes(self, item_dir: Path) -> dict[str, tuple]:
        return saved_shapes(item_dir)

    def state_of(self, restored: list) -> dict:
        return {"stages": restored}

    def parts(self, state: dict) -> list:
        return [p for p in state["stages"] if p is not None]  # one program per stage mesh this process drives


STAGES = StagesItem()
