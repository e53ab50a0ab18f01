"""Preference pairs as rows of one sequence each: the pair's chosen sequence on row 2i, its rejected one on row
2i + 1 (so both always share a micro-batch and a device: train.micro_batch is even); packed rows of whole pairs
are jaxmem.io.documents.pair_packing's."""
from __future__ import annotations

import numpy as np

from jaxmem.io.documents.packing import IGNORE_INDEX

# The batch array of stored reference log-probs, [A, rows, T] int32 holding float32 bits: a sequence's reference
# sum at its first position, zeros elsewhere (preference.reference=precompute: jaxmem.preference.precompute).
REFERENCE_KEY = "reference_logps"
SKIPS = {"missing": "a missing or mistyped field", "identical": "chosen equal to rejected",
         "long_prompt": "a prompt over data.max_prompt_len", "empty": "a completion empty after truncation"}


def pairs_summary(stats: dict) -> str:
    skips = ", ".join(f"{stats[f'skipped_{k}']} for {what}" for k, what in SKIPS.items() if stats[f"skipped_{k}"])
    return (f"{stats['pairs']} pairs of {stats['records']} records, {stats['cut']} with a completion cut from the "
            f"end" + (f"; skipped {skips}" if skips else ""))


class PairRows:
    """Rows of pairs for global sample indices: sample n is pair order[(n // 2) mod pairs] of its epoch (a
    seeded shuffle per epoch), the chosen side for even n, the rejected for odd."""

    def __init__(self, pairs: list, seq_len: int, seed: int, stats: dict, decode=None):
        self.pairs, self.seq_len, self.seed, self.stats, self.decode = pairs, seq_len, seed, stats, decode
        self._orders: dict[int, np.ndarray] = {}
        self.reference: np.ndarray | None = None  # [pairs, 2] stored reference sums, once computed

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.pairs))
        return self._orders[epoch]

    def summary(self) -> str:
        """One line: the pairs, what was cut and skipped (packed rows: and how they pack)."""
        return pairs_summary(self.stats)

    @property
    def n_rows(self) -> int:
        """Rows of one epoch: two a pair."""
        return 2 * len(self.pairs)

    def pair_of(self, n: int) -> int:
        k = int(n) // 2
        return int(self._order(k // len(self.pairs))[k % len(self.pairs)])

    def sequence(self, n: int) -> tuple[list, int]:
        """(the token ids of sample n, the prompt's length)."""
        prompt, chosen, rejected = self.pairs[self.pair_of(n)]
        return prompt + (chosen if int(n) % 2 == 0 else rejected), len(prompt)

    def rows(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """inputs and labels of global samples `indices` (with REFERENCE_KEY once the reference is stored)."""
        return self._rows([(self.pair_of(n), int(n) % 2) for n in indices])

    def pair_rows(self, pair_ids) -> dict[str, np.ndarray]:
        """The rows of pairs `pair_ids` in that order, chosen then rejected (the precompute pass)."""
        return self._rows([(int(k), side) for k in pair_ids for side in (0, 1)])

    def _rows(self, slots: list) -> dict[str, np.ndarray]:
        inputs = np.zeros((len(slots), self.seq_len), np.int32)
        labels = np.full((len(slots), self.seq_len), IGNORE_INDEX, np.int32)
        for i, (k, side) in enumerate(slots):
            prompt = self.pairs[k][0]
            ids = prompt + self.pairs[k][1 + side]
            positions = len(ids) - 1
            inputs[i, :positions] = ids[:-1]
            labels[i, len(prompt) - 1:positions] = ids[len(prompt):]
        out = {"inputs": inputs, "labels": labels}
        if self.reference is not None:
            stored = np.zeros((len(slots), self.seq_len), np.float32)
            stored[:, 0] = [self.reference[k, side] for k, side in slots]
            out[REFERENCE_KEY] = stored.view(np.int32)
        return out

    def describe(self, pairs: int = 1) -> str:
        """The first `pairs` pairs of the first epoch: the prompt, then each completion with its trained tokens
        in [[ ]] (the labels' mask), the lengths, and the summary line."""
        out = [pairs_summary(self.stats)]
        for k in range(min(pairs, len(self.pairs))):
            prompt, chosen, rejected = self.pairs[self.pair_of(2 * k)]
            out.append(f"--- pair {k}: prompt {len(prompt)} tokens, chosen {len(chosen)}, rejected {len(rejected)} "
                       f"(trained: the completion's tokens, in [[ ]])")
            out.append(self.decode(prompt))
            for name, ids in (("chosen", chosen), ("rejected", rejected)):
                out.append(f"{name}: [[{self.decode(ids)}]]")
        return "\n".join(out)
