"""Documents packed into rows of seq_len positions, and the rows a global sample index reads.

A document of L ids fills L - 1 positions: inputs ids[:-1], labels ids[1:] where trained (else
IGNORE_INDEX), so no position predicts the next document's first token. The packed index is three
arrays: for row r, placements row_starts[r]:row_starts[r + 1] of (piece_start, piece_length) into the
token stream, laid out left to right; the rest of the row is padding.
"""
from __future__ import annotations

import numpy as np

from jaxmem.config.schema import ConfigError

IGNORE_INDEX = -100  # the label the cross-entropy kernels skip (jaxmem.kernels.cross_entropy.reference)
PAD_SEGMENT = -1


def cut_pieces(offsets: np.ndarray, seq_len: int, overlong: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(piece starts, piece position counts, counts): every document as pieces of at most seq_len positions.

    A piece of n positions covers ids[start : start + n + 1]; with overlong=split, a document of L - 1 >
    seq_len positions becomes pieces ids[k*seq_len : k*seq_len + seq_len + 1] (neighbours share one id, so
    every label is kept once); with drop it is left out. Documents of one id have nothing to predict.
    """
    starts, positions = offsets[:-1], np.diff(offsets) - 1
    fits = (positions >= 1) & (positions <= seq_len)
    over = positions > seq_len
    piece_starts, piece_positions = [starts[fits]], [positions[fits]]
    order = [np.flatnonzero(fits).astype(np.float64)]
    if overlong == "split":
        for doc in np.flatnonzero(over):
            k = np.arange(-(-positions[doc] // seq_len))
            piece_starts.append(starts[doc] + k * seq_len)
            piece_positions.append(np.minimum(seq_len, positions[doc] - k * seq_len))
            order.append(doc + k / len(k))  # pieces stay where their document was, in order
    elif overlong != "drop":
        raise ConfigError(f"data.overlong: {overlong!r} is not allowed; use one of split, drop")
    by_document = np.argsort(np.concatenate(order), kind="stable")
    counts = {"documents": len(positions), "dropped_overlong": int(over.sum()) if overlong == "drop" else 0,
              "split_overlong": int(over.sum()) if overlong == "split" else 0}
    return (np.concatenate(piece_starts)[by_document].astype(np.int64),
            np.concatenate(piece_positions)[by_document].astype(np.int64), counts)


def pack(lengths: np.ndarray, seq_len: int, packing: str) -> tuple[np.ndarray, np.ndarray]:
    """(row_starts [n_rows + 1], pieces in row order): which pieces (by index) fill each row."""
    if packing == "none":
        return np.arange(len(lengths) + 1, dtype=np.int64), np.arange(len(lengths), dtype=np.int64)
    if packing == "greedy":
        rows, fill = [], seq_len + 1
        for n in lengths.tolist():
            if fill + n > seq_len:
                rows.append(0)
                fill = 0
            rows[-1] += 1
            fill += n
        counts = np.asarray(rows, np.int64)
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), np.arange(len(lengths), dtype=np.int64)
    if packing == "first_fit":
        return _first_fit(lengths, seq_len)
    raise ConfigError(f"data.packing: {packing!r} is not allowed; use one of none, greedy, first_fit")


def _first_fit(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Longest first (stable), each into the first row with room: a max tree over the rows' free room."""
    order = np.argsort(-lengths, kind="stable")
    size = 1
    while size < max(len(lengths), 1):
        size *= 2
    room = [0] * (2 * size)  # room[size + r] = free positions of row r; rows not yet opened hold seq_len
    for r in range(size):
        room[size + r] = seq_len
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    row_of = np.empty(len(lengths), np.int64)
    for piece in order.tolist():
        n, node = int(lengths[piece]), 1
        while node < size:  # descend to the leftmost row with room >= n (a new row always has room)
            node = 2 * node if room[2 * node] >= n else 2 * node + 1
        row_of[piece] = node - size
        room[node] -= n
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    n_rows = int(row_of.max()) + 1 if len(row_of) else 0
    in_rows = order[np.argsort(row_of[order], kind="stable")]  # within a row: the order placed
    counts = np.bincount(row_of, minlength=n_rows)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64), in_rows.astype(np.int64)


class PackedRows:
    """Packed rows of a tokenized record set; row n of the run is a pure function of (files, settings, seed, n)."""

    def __init__(self, documents: dict[str, np.ndarray], index: dict[str, np.ndarray], seq_len: int, seed: int,
                 stats: dict, decode=None):
        self.ids, self.trained, self.offsets = documents["ids"], documents["trained"], documents["offsets"]
        self.row_starts, self.piece_starts, self.piece_positions = (
            index["row_starts"], index["piece_starts"], index["piece_positions"])
        self.seq_len, self.seed, self.stats, self._decode = seq_len, seed, stats, decode
        self.n_rows = len(self.row_starts) - 1
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:  # batches walk forward: keep this epoch and the one before
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._orders[epoch]

    def row_of(self, indices: np.ndarray) -> np.ndarray:
        """The packed row that each global sample index reads."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        if indices.size and indices.min() < 0:
            raise ValueError(f"sample indices must be non-negative, got {int(indices.min())}")
        rows = np.empty(len(indices), np.int64)
        for epoch in np.unique(indices // self.n_rows):
            here = indices // self.n_rows == epoch
            rows[here] = self._order(int(epoch))[indices[here] % self.n_rows]
        return rows

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        rows = self.row_of(indices)
        shape = (len(rows), self.seq_len)
        out = {"inputs": np.zeros(shape, np.int32), "labels": np.full(shape, IGNORE_INDEX, np.int32),
               "segment_ids": np.full(shape, PAD_SEGMENT, np.int32), "positions": np.zeros(shape, np.int32)}
        for i, row in enumerate(rows.tolist()):
            column = 0
            for segment, piece in enumerate(range(self.row_starts[row], self.row_starts[row + 1])):
                start, n = int(self.piece_starts[piece]), int(self.piece_positions[piece])
                here = slice(column, column + n)
                out["inputs"][i, here] = self.ids[start:start + n]
                out["labels"][i, here] = np.where(self.trained[start + 1:start + n + 1],
                                                  self.ids[start + 1:start + n + 1], IGNORE_INDEX)
                out["segment_ids"][i, here] = segment
                out["positions"][i, here] = np.arange(n)
                column += n
        return out

    def describe(self, tokenizer_decode=None, documents: int = 1) -> str:
        decode = tokenizer_decode or self._decode or (lambda ids: " ".join(map(str, ids)))
        lines = []
        for doc in range(min(documents, len(self.offsets) - 1)):
            ids = self.ids[self.offsets[doc]:self.offsets[doc + 1]].tolist()
            trained = self.trained[self.offsets[doc]:self.offsets[doc + 1]].tolist()
            text, run = [], 0
            while run < len(ids):
                end = run
                while end < len(ids) and trained[end] == trained[run]:
                    end += 1
                piece = decode(ids[run:end])
                text.append(f"⟦{piece}⟧" if trained[run] else piece)
                run = end
            lines.append(f"document {doc}: {''.join(text)}")
        s = self.stats
        lines.append(f"{s['documents']} documents -> {s['rows']} rows of {self.seq_len}: {s['tokens']} tokens "
                     f"({s['efficiency']:.1%} filled; a document of n tokens fills n - 1 positions, its last "
                     f"token is only a label), {s['trained_tokens']} trained, "
                     f"{s['split_overlong']} split and {s['dropped_overlong']} dropped as overlong"
                     + (f", {s['skipped_empty']} records with no messages skipped" if s["skipped_empty"] else ""))
        return "\n".join(lines)


def packing_stats(documents: dict[str, np.ndarray], index: dict[str, np.ndarray], counts: dict, seq_len: int) -> dict:
    trained_before = np.concatenate([[0], np.cumsum(documents["trained"], dtype=np.int64)])
    starts, n = index["piece_starts"], index["piece_positions"]
    trained = int((trained_before[starts + n + 1] - trained_before[starts + 1]).sum())
    rows, tokens = len(index["row_starts"]) - 1, int(n.sum())
    return {**counts, "rows": rows, "tokens": tokens, "trained_tokens": trained,
            "efficiency": tokens / (rows * seq_len) if rows else 0.0,
            "skipped_empty": int(documents["skipped_empty"]) if "skipped_empty" in documents else 0}
