"""Safetensors shards: lazy slice reads from a checkpoint directory, tensor-by-tensor shard writes."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxmem.config import ConfigError

INDEX_FILE = "model.safetensors.index.json"
_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}


def _header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of one .safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


class CheckpointReader:
    """Reads slices of named tensors from the shards of a local checkpoint; nothing is read eagerly."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{directory}: no *.safetensors files (and no {INDEX_FILE})")
        self._file_of: dict[str, Path] = {}
        self._handles = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise ConfigError(f"{index}: lists {name}, which is not in {directory}")
            handle = safe_open(str(path), framework="numpy")
            self._handles[path] = handle
            for key in handle.keys():
                self._file_of[key] = path
        self._memmaps: dict[str, np.ndarray] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice `index` of tensor `name`; only the pages it covers are read from disk."""
        path = self._file_of[name]
        part = self._handles[path].get_slice(name)
        dtype = part.get_dtype()
        if dtype != "BF16":
            return np.asarray(part[index])
        # safetensors' numpy backend cannot build bfloat16 arrays: map the bytes and view them with ml_dtypes.
        if name not in self._memmaps:
            start, header = _header(path)
            begin, _ = header[name]["data_offsets"]
            self._memmaps[name] = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", offset=start + begin,
                                            shape=tuple(header[name]["shape"]))
        return np.array(self._memmaps[name][index])


def nbytes(shape: Iterable[int], dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def plan_shards(entries: list[tuple[str, tuple, np.dtype]], max_bytes: int) -> list[list[tuple[str, tuple, np.dtype]]]:
    """Groups tensors in order into shards of at most `max_bytes` (a bigger tensor gets a shard alone)."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        n = nbytes(entry[1], entry[2])
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    return shards


def write_shard(path: Path | None, entries: list[tuple[str, tuple, np.dtype]], produce: Callable[[str], np.ndarray]):
    """Writes one .safetensors file, asking `produce(name)` for one tensor at a time.

    With `path=None` the tensors are still produced (every process must join the gathers) but not written.
    """
    header, offset = {}, 0
    for name, shape, dtype in entries:
        n = nbytes(shape, dtype)
        header[name] = {"dtype": _DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    sink = open(path, "wb") if path is not None else None
    try:
        if sink:
            sink.write(struct.pack("<Q", len(text)) + text)
        for name, shape, dtype in entries:
            array = np.ascontiguousarray(produce(name), dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {array.shape}, planned {tuple(shape)}")
            if sink:
                sink.write(memoryview(array.reshape(-1).view(np.uint8)))  # no copy
    finally:
        if sink:
            sink.close()
