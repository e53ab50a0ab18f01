"""build_rows: records -> cached token documents -> cached packed row index -> PackedRows.

Both caches are .npz files under data.cache_dir named by a sha256 of what decides their content. They are
written to a unique temporary file and moved into place with os.replace, so processes (hosts) building the
same cache at once each write a whole file and readers only ever see a whole file.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
import zipfile
from pathlib import Path

import numpy as np

from jaxmem.io.documents.packing import PackedRows, cut_pieces, pack, packing_stats
from jaxmem.io.documents.reading import read_records, record_files
from jaxmem.io.documents.tokenize import load_tokenizer, payloads, tokenize_documents, tokenizer_spec
from jaxmem.config.schema import ConfigError, DataConfig

CACHE_VERSION = 2  # bump when tokenization or packing changes what a cached file holds


def cache_dir(data: DataConfig) -> Path:
    return Path(data.cache_dir).expanduser() if data.cache_dir else Path.home() / ".cache" / "jaxmem" / "data"


def _digest(parts: list[bytes | str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        part = part.encode() if isinstance(part, str) else part
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: parts cannot run into each other
        h.update(part)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path) as saved:
            return {key: saved[key] for key in saved.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):  # absent, or damaged by something other than us: rebuild
        return None


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_rows(data: DataConfig, *, path: str, seq_len: int, vocab_size: int, seed: int, log=print) -> PackedRows:
    """Reads `path` (data.kind in jsonl|parquet|hf), tokenizes (cached), packs (cached), returns the rows.

    Bad input is a one-line ConfigError naming the key and file, raised before anything is written.
    """
    if seq_len < 1:
        raise ConfigError(f"train.seq_len: {seq_len} is not a positive number of positions")
    for key, allowed in (("packing", ("none", "greedy", "first_fit")), ("overlong", ("split", "drop")),
                         ("train_on", ("assistant", "all")), ("format", ("text", "prompt_completion", "messages"))):
        if getattr(data, key) not in allowed:
            raise ConfigError(f"data.{key}: {getattr(data, key)!r} is not allowed; use one of {', '.join(allowed)}")
    if data.workers < 0:
        raise ConfigError(f"data.workers: {data.workers} is not allowed; use 0 (one per CPU core, at most 8) "
                          "or a positive number of processes")
    files = record_files(data.kind, path)
    spec, tokenizer_bytes = tokenizer_spec(data, vocab_size)
    settings = [str(CACHE_VERSION), data.kind, data.format, data.train_on, data.text_field, data.prompt_field,
                data.completion_field, data.messages_field] + ([json.dumps(data.roles, sort_keys=True)]
                                                               if data.roles else [])
    documents_key = _digest(settings + tokenizer_bytes + [f.name + _file_digest(f) for f in files])
    root = cache_dir(data)
    documents_file = root / f"documents-{documents_key[:32]}.npz"
    documents = _load(documents_file)
    if documents is None:
        items, skipped = payloads(data, read_records(data.kind, files))
        if not items:
            raise ConfigError(f"data.path: every record of {path} has an empty {data.messages_field!r} list; "
                              "nothing to train on")
        documents = dict(tokenize_documents(spec, items, data.workers), skipped_empty=np.int64(skipped))
        _save(documents_file, documents)
        log(f"tokenized {len(items)} records of {path} into {len(documents['ids'])} tokens "
            f"(cached in {documents_file})")
    index_key = _digest([documents_key, str(seq_len), data.packing, data.overlong])
    index_file = root / f"rows-{index_key[:32]}.npz"
    index = _load(index_file)
    if index is None:
        starts, positions, counts = cut_pieces(documents["offsets"], seq_len, data.overlong)
        if not len(starts):
            raise ConfigError(f"data.path: {path} leaves no documents to train on with train.seq_len={seq_len} "
                              f"and data.overlong={data.overlong} ({counts['documents']} documents, "
                              f"{counts['dropped_overlong']} dropped as overlong); use data.overlong=split")
        row_starts, order = pack(positions, seq_len, data.packing)
        index = {"row_starts": row_starts, "piece_starts": starts[order], "piece_positions": positions[order],
                 **{f"count_{k}": np.int64(v) for k, v in counts.items()}}
        _save(index_file, index)
    counts = {k[len("count_"):]: int(v) for k, v in index.items() if k.startswith("count_")}
    stats = packing_stats(documents, index, counts, seq_len)
    if stats["dropped_overlong"]:
        log(f"dropped {stats['dropped_overlong']} of {stats['documents']} documents longer than "
            f"train.seq_len + 1 = {seq_len + 1} tokens (data.overlong=drop)")
    tokenizer = load_tokenizer(data.tokenizer)
    return PackedRows(documents, index, seq_len, seed, stats,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
