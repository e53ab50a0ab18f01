"""Preference pairs packed into rows (data.format=preference with data.packing greedy or first_fit): whole pairs
only, each pair as two consecutive segments of one row, its chosen sequence (prompt + chosen completion) then its
rejected one (prompt + rejected completion), with distinct segment ids (pair j of a row: segments 2j and
2j + 1), positions restarting per segment and labels on the completion's tokens only. The model masks attention
by segment, so a sequence sees only its own tokens, as on a row of its own.

The pairs are packed once, in the records' order (data.packing: greedy fills rows in order, first_fit puts the
longest first, each into the first row with room: jaxmem.io.documents.packing.pack); a run's sample n is then
packed row order[n mod rows] of its epoch, a seeded shuffle of the rows per epoch (as packed documents are), so
a row is a pure function of (files, settings, seed, n) and a resume continues exactly. train.micro_batch counts
packed rows; each row holds as many whole pairs as fit.
"""
from __future__ import annotations

import numpy as np

from jaxmem.io.documents.packing import IGNORE_INDEX, PAD_SEGMENT, pack
from jaxmem.io.documents.pair_rows import REFERENCE_KEY, PairRows, pairs_summary


def pair_positions(pair) -> int:
    """Positions a pair fills: its two sequences of L tokens fill L - 1 each."""
    prompt, chosen, rejected = pair[:3]
    return 2 * len(prompt) + len(chosen) + len(rejected) - 2


class PackedPairRows(PairRows):
    """Rows of whole pairs for global sample indices (each index reads one packed row)."""

    def __init__(self, pairs: list, seq_len: int, seed: int, stats: dict, packing: str, decode=None):
        super().__init__(pairs, seq_len, seed, stats, decode)
        lengths = np.asarray([pair_positions(p) for p in pairs], np.int64)
        self.row_starts, self.pair_order = pack(lengths, seq_len, packing)
        self._row_orders: dict[int, np.ndarray] = {}
        filled = int(lengths.sum())
        self.stats = dict(stats, rows=self.n_rows, efficiency=filled / (self.n_rows * seq_len), packing=packing)

    @property
    def n_rows(self) -> int:
        """Packed rows of one epoch."""
        return len(self.row_starts) - 1

    def _row_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._row_orders:  # batches walk forward: keep this epoch and the one before
            self._row_orders = {e: o for e, o in self._row_orders.items() if e == epoch - 1}
            self._row_orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
        return self._row_orders[epoch]

    def row_of(self, indices) -> np.ndarray:
        """The packed row each global sample index reads."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        return np.asarray([self._row_order(int(n) // self.n_rows)[int(n) % self.n_rows] for n in indices], np.int64)

    def row_pairs(self, row: int) -> list[int]:
        """The pairs of packed row `row`, in their order along the row."""
        return self.pair_order[self.row_starts[row]:self.row_starts[row + 1]].tolist()

    def rows(self, indices) -> dict[str, np.ndarray]:
        return self.packed_rows(self.row_of(indices))

    def packed_rows(self, row_ids) -> dict[str, np.ndarray]:
        """inputs, labels, segment_ids, positions of packed rows `row_ids` (with REFERENCE_KEY once the reference
        is stored: each segment's reference sum at its first position)."""
        shape = (len(row_ids), self.seq_len)
        out = {"inputs": np.zeros(shape, np.int32), "labels": np.full(shape, IGNORE_INDEX, np.int32),
               "segment_ids": np.full(shape, PAD_SEGMENT, np.int32), "positions": np.zeros(shape, np.int32)}
        stored = None if self.reference is None else np.zeros(shape, np.float32)
        for i, row in enumerate(np.asarray(row_ids).tolist()):
            column = 0
            for j, k in enumerate(self.row_pairs(row)):
                prompt = self.pairs[k][0]
                for side in (0, 1):
                    ids = prompt + self.pairs[k][1 + side]
                    n = len(ids) - 1
                    here = slice(column, column + n)
                    out["inputs"][i, here] = ids[:-1]
                    out["labels"][i, column + len(prompt) - 1:column + n] = ids[len(prompt):]
                    out["segment_ids"][i, here] = 2 * j + side
                    out["positions"][i, here] = np.arange(n)
                    if stored is not None:
                        stored[i, column] = self.reference[k, side]
                    column += n
        if stored is not None:
            out[REFERENCE_KEY] = stored.view(np.int32)
        return out

    def describe(self, pairs: int = 1) -> str:
        """The first packed rows of the first epoch holding `pairs` pairs: each segment (its pair and side,
        positions) with its prompt and its trained completion tokens in [[ ]], then the packing line."""
        out = [pairs_summary(self.stats), self.packing_line()]
        shown = 0
        for row in self._row_order(0).tolist():
            if shown >= pairs:
                break
            members = self.row_pairs(row)
            used = sum(pair_positions(self.pairs[k]) for k in members)
            plural = "" if len(members) == 1 else "s"
            out.append(f"--- row {row}: {len(members)} pair{plural} in {2 * len(members)} segments, {used} of "
                       f"{self.seq_len} positions (trained: the completions' tokens, in [[ ]])")
            column = 0
            for j, k in enumerate(members):
                prompt = self.pairs[k][0]
                for side, name in enumerate(("chosen", "rejected")):
                    completion = self.pairs[k][1 + side]
                    n = len(prompt) + len(completion) - 1
                    out.append(f"segment {2 * j + side} (pair {k} {name}, positions {column}:{column + n}): "
                               f"{self.decode(prompt)}[[{self.decode(completion)}]]")
                    column += n
                shown += 1
        return "\n".join(out)

    def summary(self) -> str:
        return f"{pairs_summary(self.stats)}; {self.packing_line()}"

    def packing_line(self) -> str:
        s = self.stats
        return (f"{len(self.pairs)} pairs packed in {s['rows']} rows of {self.seq_len} positions (data.packing="
                f"{s['packing']}, {s['efficiency']:.1%} filled; each pair's chosen and rejected sequences are two "
                "segments of one row, attention kept inside each)")
