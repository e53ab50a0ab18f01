"""Deterministic, resumable token sources and the per-process batch iterator.

Every sample has a global index n; a step's batch is the block of samples
[position, position + grad_accum x rows) laid out as [grad_accum, rows, seq_len + 1]
(inputs are [..., :-1], labels [..., 1:]). A sample's tokens are a pure function
of (config, n), so resuming only needs the position, and each process builds
only the rows its devices hold.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxmem.config.schema import Config, ConfigError
from jaxmem.config.schema import RECORD_KINDS
from jaxmem.config.preference import resolved_reference
from jaxmem.io.documents import build_rows
from jaxmem.io.documents.pairs import REFERENCE_KEY, build_pairs  # noqa: F401 (REFERENCE_KEY: the core's name)

# The synthetic "language" is fixed (independent of train.seed) so that every seed
# trains on the same task; train.seed only picks which sentences are drawn.
_LANGUAGE_SEED = 20240607
_SUCCESSORS = 2  # each token may be followed by this many tokens: loss floor ~ln 2


def check_data_files(cfg: Config) -> None:
    """The data files a run reads exist (one line naming the key); runs call it before anything compiles."""
    d = cfg.data
    for key, path in (("data.path", d.path if d.kind != "synthetic" else ""), ("data.tokenizer", d.tokenizer),
                      ("data.chat_template", d.chat_template), ("eval.path", cfg.eval.path)):
        if path and not Path(path).exists():
            raise ConfigError(f"{key}: file {path} not found")
        if path and not (Path(path).is_file() or Path(path).is_dir()):  # a FIFO, a socket, a device
            raise ConfigError(f"{key}: {path} is not a regular file or folder")
    if d.kind in ("text", "bin") and d.path and not Path(d.path).is_file():
        raise ConfigError(f"data.path: {d.path} is not a file (data.kind={d.kind} reads one file)")




def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of a step's batch: token rows for the stream sources; for records inputs and labels (loss
    masks), plus segment ids and positions when documents are packed (attention stays inside a document,
    RoPE restarts). One document per row needs neither: right padding is never attended to. Preference pairs
    are one sequence per row, or packed whole pairs (a sequence a segment); with stored reference log-probs they
    carry them too."""
    if cfg.data.kind not in RECORD_KINDS:
        return ("tokens",)
    packed = ("segment_ids", "positions") if cfg.data.packing != "none" else ()
    if cfg.data.format == "preference":
        stored = resolved_reference(cfg) == "precompute"
        return ("inputs", "labels") + packed + ((REFERENCE_KEY,) if stored else ())
    return ("inputs", "labels") + packed


class TokenSource(Protocol):
    def samples(self, indices: np.ndarray, length: int) -> np.ndarray | dict[str, np.ndarray]:
        """Token rows [len(indices), length] (int32) for global sample indices, or for records a dict of
        such arrays (inputs, labels, segment_ids, positions; length = seq_len)."""


class RecordSource:
    """Rows of packed documents (jaxmem.io.documents): inputs, labels with the loss mask, segment ids and
    positions per row, a pure function of (files, config, sample index) like the stream sources."""

    def __init__(self, rows, keys: tuple[str, ...]):
        self.rows, self.keys = rows, keys

    def samples(self, indices: np.ndarray, length: int) -> dict[str, np.ndarray]:
        if length != self.rows.seq_len:
            raise ValueError(f"rows were packed for seq_len {self.rows.seq_len}, asked for length {length}")
        out = self.rows.rows(np.asarray(indices, np.int64))
        return {key: out[key] for key in self.keys}


class SyntheticSource:
    """A first-order Markov chain with a few successors per token: a tiny model learns it fast.

    Loss starts near ln(vocab_size) and falls towards ~ln(2) as the model learns the
    transition table; sample n is drawn from its own generator seeded by (seed, n).
    """

    def __init__(self, vocab_size: int, seed: int):
        table_rng = np.random.default_rng([_LANGUAGE_SEED, vocab_size])
        self.successors = table_rng.integers(0, vocab_size, (vocab_size, _SUCCESSORS))
        self.vocab_size, self.seed = vocab_size, seed

    def samples(self, indices: np.ndarray, length: int) -> np.ndarray:
        starts = np.empty(len(indices), np.int64)
        choices = np.empty((len(indices), length - 1), np.int64)
        for i, n in enumerate(indices):
            rng = np.random.default_rng([self.seed, int(n)])
            starts[i] = rng.integers(0, self.vocab_size)
            choices[i] = rng.integers(0, _SUCCESSORS, length - 1)
        out = np.empty((len(indices), length), np.int64)
        out[:, 0] = starts
        for t in range(1, length):  # vectorized over rows; length is at most a few thousand
            out[:, t] = self.successors[out[:, t - 1], choices[:, t - 1]]
        return out.astype(np.int32)


class StreamSource:
    """Windows of seq_len + 1 tokens from one token stream, in a seeded order per epoch.

    Window w covers tokens [w * seq_len, w * seq_len + seq_len + 1), so consecutive
    windows share one token (every token is a label exactly once per epoch).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, vocab_size: int, origin: str):
        self.tokens, self.seq_len, self.seed, self.vocab_size, self.origin = tokens, seq_len, seed, vocab_size, origin
        self.n_windows = (len(tokens) - 1) // seq_len
        self._orders: dict[int, np.ndarray] = {}
        if self.n_windows < 1:
            raise ConfigError(f"data.path: {origin} holds {len(tokens)} tokens, fewer than "
                              f"train.seq_len + 1 = {seq_len + 1}")

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:  # batches walk forward: keep this epoch and the one before
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
        return self._orders[epoch]

    def samples(self, indices: np.ndarray, length: int) -> np.ndarray:
        if length != self.seq_len + 1:
            raise ValueError(f"windows were cut for seq_len {self.seq_len}, asked for length {length}")
        indices = np.asarray(indices, np.int64)
        windows = np.empty(len(indices), np.int64)
        for epoch in np.unique(indices // self.n_windows):
            here = indices // self.n_windows == epoch
            windows[here] = self._order(int(epoch))[indices[here] % self.n_windows]
        rows = np.asarray(self.tokens[(windows * self.seq_len)[:, None] + np.arange(length)])
        _check_vocab(rows, self.vocab_size, self.origin)
        return rows.astype(np.int32)


def _check_vocab(tokens: np.ndarray, vocab_size: int, origin: str) -> None:
    top = int(tokens.max()) if tokens.size else 0
    if top >= vocab_size:
        raise ConfigError(f"data.path: {origin} holds token id {top} >= model.vocab_size={vocab_size}; "
                          "use a tokenizer within the vocabulary or raise model.vocab_size")


def _text_tokens(cfg: Config) -> np.ndarray:
    path = Path(cfg.data.path)
    if not cfg.data.tokenizer:  # byte-level: every byte is a token, so any file is valid input
        return np.frombuffer(path.read_bytes(), np.uint8)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.path: {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          f"data.tokenizer={cfg.data.tokenizer} needs UTF-8") from None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer: needs the `tokenizers` package (pip install 'jaxmem[data]')") from None
    try:
        tokenizer = Tokenizer.from_file(cfg.data.tokenizer)
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer} is not a tokenizer.json ({first})") from None
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int64)


_HEAD = 4096  # tokens of a bin file read at once to catch a wrong data.bin_dtype before training


def _bin_tokens(cfg: Config) -> np.ndarray:
    path, dtype = cfg.data.path, np.dtype(cfg.data.bin_dtype)
    size = Path(path).stat().st_size
    if size == 0:
        raise ConfigError(f"data.path: {path} is empty; expected {cfg.data.bin_dtype} token ids")
    if size % dtype.itemsize:
        raise ConfigError(f"data.path: {path} is {size} bytes, not a whole number of "
                          f"data.bin_dtype={cfg.data.bin_dtype} tokens")
    tokens = np.memmap(path, dtype=dtype, mode="r")  # read lazily: only the rows asked for
    _check_bin_head(np.asarray(tokens[:_HEAD]), cfg)
    return tokens


def _check_bin_head(head: np.ndarray, cfg: Config) -> None:
    """A file of the other token width reads as valid-looking ids; its first tokens give it away."""
    path, vocab = cfg.data.path, cfg.model.vocab_size
    # uint32 ids below 65536 read as uint16: every second value is the zero high half.
    if head.dtype == np.uint16 and len(head) >= 64 and head[0::2].any() and not head[1::2].any():
        raise ConfigError(f"data.path: {path} looks like uint32 tokens (every second uint16 is 0); "
                          "set data.bin_dtype=uint32")
    # uint16 ids read as uint32: two ids fused into one value above 65535.
    if head.dtype == np.uint32 and vocab <= 1 << 16 and head.size and int(head.max()) >= 1 << 16:
        raise ConfigError(f"data.path: {path} holds token id {int(head.max())} >= model.vocab_size={vocab} "
                          "and looks like uint16 tokens; set data.bin_dtype=uint16")
    _check_vocab(head, vocab, path)


def make_source(cfg: Config, path: str | None = None, key: str = "data.path",
                refuse_untrained: bool = True) -> TokenSource:
    """The token source that `data.kind` names, reading `path` (default data.path; eval.path for held-out
    data). Missing files are refused here, in one line: plans never read the data; so are records that leave
    no token to train on after masking (unless `refuse_untrained` is False: `jaxmem data` warns instead)."""
    check_data_files(cfg)
    if path is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path))
    kind, seed, vocab = cfg.data.kind, cfg.train.seed, cfg.model.vocab_size
    if kind in RECORD_KINDS and cfg.data.format == "preference":
        log = lambda line: print(f"jaxmem data: {cfg.data.path}: {line}", file=sys.stderr, flush=True)  # noqa: E731
        pairs = build_pairs(cfg.data, path=cfg.data.path, seq_len=cfg.train.seq_len, vocab_size=vocab, seed=seed,
                            log=log)
        return RecordSource(pairs, tuple(k for k in batch_keys(cfg) if k != REFERENCE_KEY))  # stored: once computed
    if kind in RECORD_KINDS:
        log = lambda line: print(f"jaxmem data: {line}", file=sys.stderr, flush=True)  # noqa: E731
        rows = build_rows(cfg.data, path=cfg.data.path, seq_len=cfg.train.seq_len, vocab_size=vocab, seed=seed,
                          log=log)
        log(f"{cfg.data.path}: {packing_summary(rows, cfg.train.seq_len)}")
        if refuse_untrained and not rows.stats["trained_tokens"]:
            raise ConfigError(untrained_line(cfg, key))
        return RecordSource(rows, batch_keys(cfg))
    if kind == "synthetic":
        return SyntheticSource(vocab, seed)
    if kind == "text":
        tokens = _text_tokens(cfg)
        what = f"{cfg.data.path} (tokenized with {cfg.data.tokenizer or 'bytes'})"
        _check_vocab(tokens, vocab, what)  # a text file is small enough to check whole
        return StreamSource(tokens, cfg.train.seq_len, seed, vocab, what)
    if kind == "bin":
        return StreamSource(_bin_tokens(cfg), cfg.train.seq_len, seed, vocab, cfg.data.path)
    raise ConfigError(f"data.kind: {kind!r} is not allowed; use one of 'synthetic', 'text', 'bin', "
                      f"{', '.join(repr(k) for k in RECORD_KINDS)}")


def untrained_line(cfg: Config, key: str = "data.path") -> str:
    """Why records that leave no trained token cannot train (the loss would be taken over nothing)."""
    d = cfg.data
    return (f"{key}: {d.path} leaves no token to train on after masking (data.format={d.format}, "
            f"data.train_on={d.train_on}: e.g. chats without an assistant turn); give records with assistant "
            "turns or completions, or set data.train_on=all")


# Why the rows hold one token per document fewer than the tokenized documents.
LABEL_SHIFT = "each document of n tokens fills n - 1 positions: its last token is only a label"


def packing_summary(rows, seq_len: int) -> str:
    """One line of packing statistics (jaxmem.io.documents.PackedRows.stats)."""
    st = rows.stats
    return (f"{st['documents']} documents in {st['rows']} rows of {seq_len} tokens, packing efficiency "
            f"{st['efficiency']:.1%}, {st['trained_tokens']} trained of {st['tokens']} tokens in rows "
            f"({LABEL_SHIFT}), "
            f"{st['split_overlong']} overlong split, {st['dropped_overlong']} dropped"
            + (f", {st['skipped_empty']} records with no messages skipped" if st.get("skipped_empty") else ""))


def process_rows(prog) -> tuple[int, int]:
    """[start, stop) of the global batch rows that this process's devices hold."""
    indices = prog.batch_sharding.addressable_devices_indices_map(prog.batch_shape).values()
    starts = [idx[1].start or 0 for idx in indices]
    stops = [prog.rows if idx[1].stop is None else idx[1].stop for idx in indices]
    return min(starts), max(stops)


class Batches:
    """Iterator of sharded global batches, starting at `step` with `position` samples consumed.

    With the defaults, the batch of step i starts at sample i x grad_accum x rows: a pure
    function of (config, i). A resume passes the saved position, so data order continues
    even if the batch layout changed.
    """

    def __init__(self, source: TokenSource, prog, step: int = 0, position: int | None = None):
        self.source, self.prog = source, prog
        self.accum, self.rows, length = prog.batch_shape
        self.length = length
        self.per_step = self.accum * self.rows
        self.step = step
        self.position = step * self.per_step if position is None else position
        self._origin = (self.step, self.position)
        self.row_range = process_rows(prog)

    def position_at(self, step: int) -> int:
        """Samples consumed once `step` steps are done (what a checkpoint at `step` saves)."""
        start_step, start_position = self._origin
        return start_position + (step - start_step) * self.per_step

    def local_batch(self, position: int) -> np.ndarray | dict[str, np.ndarray]:
        """This process's rows [grad_accum, local rows, seq_len + 1] of the batch at `position` (for records a
        dict of [grad_accum, local rows, seq_len] arrays)."""
        grid = self.sample_indices(position)
        out = self.source.samples(grid.reshape(-1), self.length)
        shape = (*grid.shape, self.length)
        return {k: v.reshape(shape) for k, v in out.items()} if isinstance(out, dict) else out.reshape(shape)

    def sample_indices(self, position: int) -> np.ndarray:
        """The global sample indices [grad_accum, local rows] of this process's rows of the batch at `position`."""
        start, stop = self.row_range
        return position + np.arange(self.accum)[:, None] * self.rows + np.arange(start, stop)[None, :]

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = self.prog.shard_batch(self.local_batch(self.position))
        self.step += 1
        self.position += self.per_step
        return batch


def batches(cfg: Config, prog, step: int = 0, position: int | None = None) -> Batches:
    """The data iterator of a run: sharded batches for `prog`, from `step` on."""
    return Batches(make_source(cfg), prog, step, position)
