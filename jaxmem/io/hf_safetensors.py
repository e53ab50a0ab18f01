"""Safetensors shards: lazy slice reads from a checkpoint directory, tensor-by-tensor shard writes."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxmem.config.schema import ConfigError
from jaxmem.io.hf_config import read_json_object
from jaxmem.io.inside import plain_name, stays_inside

INDEX_FILE = "model.safetensors.index.json"
_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # what a weight may be stored as; ints would convert silently


def _header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, header dict) of one .safetensors file; one-line ConfigError if damaged."""
    size = path.stat().st_size
    if size < 8:
        raise ConfigError(f"{path}: {size} bytes, too short for a safetensors file (empty or truncated)")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > size - 8:
            raise ConfigError(f"{path}: header length {length} runs past the end of the file ({size} bytes); "
                              "the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
            raise ConfigError(f"{path}: header is not valid JSON ({reason}); "
                              "the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: header is not a JSON object; the file is damaged or not safetensors")
    return 8 + length, header


def _data_end(header: dict) -> int | None:
    """Bytes the tensors need after the header; None for a malformed header (safe_open then names the problem)."""
    try:
        return max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return None


def _open(path: Path):
    """safe_open, after checks that turn a damaged file into a one-line error naming it."""
    start, header = _header(path)
    end, size = _data_end(header), path.stat().st_size
    if end is not None and start + end > size:
        raise ConfigError(f"{path}: truncated; its tensors end at byte {start + end} but the file has {size} bytes")
    try:
        return safe_open(str(path), framework="numpy")
    except SafetensorError as e:
        raise ConfigError(f"{path}: not a valid safetensors file ({str(e).splitlines()[0]})") from None


def _weight_map(index: Path) -> dict[str, str]:
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ConfigError(f"{index}: weight_map must be a non-empty mapping of tensor name -> shard file")
    for key, name in weight_map.items():
        if not _inside(name):  # checked on the name alone: nothing outside the folder is opened or looked at
            raise ConfigError(f"{index}: weight_map maps {key} to {name!r}, which is not a file inside the "
                              "folder; shards are named relative to the folder, without '..'")
    return weight_map


def _inside(name: str) -> bool:
    """A shard name that stays inside the checkpoint folder: relative, without '..', not empty, no NUL."""
    return plain_name(name)


class CheckpointReader:
    """Reads slices of named tensors from the shards of a local checkpoint; nothing is read eagerly."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        index = directory / INDEX_FILE
        weight_map = _weight_map(index) if index.is_file() else None
        if weight_map is not None:
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
            if not stays_inside(directory, path):
                raise ConfigError(f"{path}: a link leading outside {directory} (to {path.resolve()}); shards are "
                                  "read from inside the folder")
            handle = _open(path)
            self._handles[path] = handle
            for key in handle.keys():
                if key in self._file_of:  # which copy would be read depends on file order
                    raise ConfigError(f"{path}: tensor {key} is also in {self._file_of[key]}; keep one copy")
                self._file_of[key] = path
        if weight_map is not None:
            self._check_index(index, weight_map)
        self._memmaps: dict[str, np.ndarray] = {}

    def _check_index(self, index: Path, weight_map: dict[str, str]) -> None:
        """A tensor found in another shard than the index says: shards of mixed downloads or revisions.

        A listed tensor that no shard holds is reported by the loader only if the model needs it.
        """
        for key, name in weight_map.items():
            if key in self._file_of and self._file_of[key] != index.parent / name:
                raise ConfigError(f"{index}: maps {key} to {name}, which does not hold it (it is in "
                                  f"{self._file_of[key].name}); the index does not match the shards")

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        """Every tensor of the shards, sorted."""
        return sorted(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype name: F32, BF16, I64, ..."""
        return self._handles[self._file_of[name]].get_slice(name).get_dtype()

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
