"""Records users bring: JSONL, Parquet, or a directory written by `datasets.Dataset.save_to_disk`.

A record comes with where it was read (`file:line` for JSONL, `file:row` otherwise), so that every
error about it names the place to fix. Reading is local only: nothing is ever downloaded.

Why not `grain` for reading and worker parallelism: a training row here is a numpy slice of a cached
index (`PackedRows.rows`), so there is no per-step read pipeline to parallelize; the only expensive
work is the one-time tokenization, which a spawn-context ProcessPoolExecutor over record chunks covers.
grain would add a dependency (and its own record formats and sharding) for none of that.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from jaxmem.config.schema import RECORD_KINDS, ConfigError
from jaxmem.io.inside import plain_name, stays_inside

_SUFFIXES = {"jsonl": (".jsonl",), "parquet": (".parquet",)}

Record = tuple[dict[str, Any], str]  # (the record, where it was read)


def record_files(kind: str, path: str) -> list[Path]:
    """The files holding the records of `path` (a file, or a directory of such files in sorted order)."""
    if kind not in RECORD_KINDS:
        raise ConfigError(f"data.kind: {kind!r} is not a record kind; use one of {', '.join(RECORD_KINDS)}")
    if not path:
        raise ConfigError(f"data.path: required with data.kind={kind}")
    root = Path(path)
    if not root.exists():
        raise ConfigError(f"data.path: {root} does not exist")
    if kind == "hf":
        return _hf_files(root)
    if root.is_file():
        return [root]
    if not root.is_dir():  # a FIFO, a socket, a device
        raise ConfigError(f"data.path: {root} is not a regular file or folder")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_SUFFIXES[kind]))
    if not files:
        raise ConfigError(f"data.path: {root} holds no {' or '.join(_SUFFIXES[kind])} files for data.kind={kind}")
    for f in files:
        if not stays_inside(root, f):
            raise ConfigError(f"data.path: {f} is a link leading outside {root} (to {f.resolve()}); the records "
                              "are read from inside the folder")
    return files


def _hf_files(root: Path) -> list[Path]:
    """The arrow files of a `save_to_disk` directory, in the order its state.json lists them."""
    if (root / "dataset_dict.json").exists():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        raise ConfigError(f"data.path: {root} is a DatasetDict (splits {', '.join(splits)}); "
                          "point data.path at one split's directory")
    state = root / "state.json"
    if not root.is_dir() or not state.exists():
        raise ConfigError(f"data.path: {root} is not a directory written by datasets' save_to_disk "
                          "(no state.json) as data.kind=hf needs")
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ConfigError(f"data.path: {state} does not list the dataset's arrow files ({e!r})") from None
    for name in names:
        if not isinstance(name, str) or not plain_name(name) or not stays_inside(root, root / name):
            raise ConfigError(f"data.path: {state} lists {name!r}, which is not a file inside {root} (an entry "
                              "names a file of the folder, without '..', and no link out of it)")
    files = [root / name for name in names]
    for f in files:
        if not f.exists():
            raise ConfigError(f"data.path: {f} is listed in {state} but missing")
    return [state, *files]  # state.json is hashed with the data: it says how the files make one dataset


def read_records(kind: str, files: list[Path]) -> list[Record]:
    """Every record of `files`; a file that does not parse is a one-line ConfigError naming it."""
    records: list[Record] = []
    for f in files:
        if kind == "jsonl":
            records.extend(_jsonl_records(f))
        elif f.suffix == ".arrow" or kind == "parquet":
            records.extend(_arrow_records(kind, f))
    if not records:
        where = files[0].parent if kind == "hf" else (files[0] if len(files) == 1 else files[0].parent)
        raise ConfigError(f"data.path: {where} holds no records; data.kind={kind} needs at least one")
    return records


def _jsonl_records(f: Path) -> Iterator[Record]:
    with f.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"data.path: {f}:{number} is not UTF-8 ({e.reason})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {f}:{number} is not valid JSON ({e.msg} at column {e.colno})") \
                    from None
            except RecursionError:  # json's decoder recurses once per level of [ or {
                raise ConfigError(f"data.path: {f}:{number} nests its JSON too deeply to read (thousands of "
                                  "levels of [ or {); a record is an object of a few levels") from None
            if not isinstance(record, dict):
                raise ConfigError(f"data.path: {f}:{number} is a JSON {type(record).__name__}, not an object "
                                  "with the record's fields")
            yield record, f"{f}:{number}"


def _arrow_records(kind: str, f: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if kind == "parquet":
            table = pq.read_table(f)
        else:  # save_to_disk writes the Arrow IPC stream format
            with pa.memory_map(str(f)) as source:
                table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.path: {f} is not a readable {kind} file ({first})") from None
    for row, record in enumerate(table.to_pylist()):
        yield record, f"{f}:row {row}"
