"""Preference pairs (data.format=preference) as rows: the pair's chosen sequence on row 2i, its rejected one on
row 2i + 1 (so both always share a micro-batch and a device: train.micro_batch is even), one sequence per row.

A record is {"prompt", "chosen", "rejected"}: plain strings (the prompt tokenized with the tokenizer's special
tokens, each completion without them and ended by eos), or TRL's conversational form (prompt a list of
messages, chosen / rejected lists of assistant messages) rendered with the chat template: the prompt as the
chat with the generation prompt, each completion as the rest of the whole chat's rendering. The prompt is
tokenized once and shared by the pair; labels cover the completion's tokens only.

Truncation: a prompt over data.max_prompt_len tokens (0: half of train.seq_len) skips the pair; completions
are cut from the end to fit train.seq_len + 1 tokens. Records missing a field, with chosen equal to rejected,
or with a completion empty after the cut are skipped and counted (`PairRows.stats`).
"""
from __future__ import annotations

import numpy as np

from jaxmem.config.schema import ConfigError, DataConfig
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.io.documents.packing import IGNORE_INDEX
from jaxmem.io.documents.reading import read_records, record_files
from jaxmem.io.documents.template_bounds import budget
from jaxmem.io.documents.tokenize import load_tokenizer, tokenizer_spec

FIELDS = ("prompt", "chosen", "rejected")
# The batch array of stored reference log-probs, [A, rows, T] int32 holding float32 bits: a row's reference sum at
# its first position, zeros elsewhere (preference.reference=precompute: jaxmem.preference.precompute).
REFERENCE_KEY = "reference_logps"
SKIPS = {"missing": "a missing or mistyped field", "identical": "chosen equal to rejected",
         "long_prompt": "a prompt over data.max_prompt_len", "empty": "a completion empty after truncation"}


class PairMaker:
    """(prompt ids, chosen ids, rejected ids) of a record, or the reason it is skipped (a SKIPS key)."""

    def __init__(self, data: DataConfig, vocab_size: int):
        spec, _ = tokenizer_spec(data, vocab_size)
        self.tokenizer = load_tokenizer(data.tokenizer)
        self.eos = [] if spec.eos_token is None else [self.tokenizer.token_to_id(spec.eos_token)]
        self.template = None if spec.template_text is None else ChatTemplate(
            spec.template_text, spec.template_origin, spec.bos_token, spec.eos_token)
        self.prompt_field = data.prompt_field

    def __call__(self, record: dict, where: str):
        values = [record.get(self.prompt_field if f == "prompt" else f) for f in FIELDS]
        if all(isinstance(v, str) for v in values):
            prompt = self.tokenizer.encode(values[0], add_special_tokens=True).ids
            chosen, rejected = (self.tokenizer.encode(v, add_special_tokens=False).ids + self.eos for v in values[1:])
        elif all(isinstance(v, list) for v in values):
            prompt, chosen, rejected = self._conversational(values, where)
        else:
            return "missing"
        if not prompt:
            return "missing"
        if chosen == rejected:
            return "identical"
        return prompt, chosen, rejected

    def _conversational(self, values: list, where: str):
        if self.template is None:
            raise ConfigError(f"data.chat_template: {where} holds message lists and the tokenizer has no chat "
                              "template; set data.chat_template to a Jinja file")
        with_prompt = self._render(values[0], where, generation=True)
        ids = []
        for completion in values[1:]:
            full = self._render(values[0] + completion, where)
            if not full.startswith(with_prompt):
                raise ConfigError(f"{self.template.origin}: the prompt of {where} renders differently followed by "
                                  "its completion, so the completion's tokens cannot be found")
            ids.append(self.tokenizer.encode(full[len(with_prompt):], add_special_tokens=False).ids)
        return self.tokenizer.encode(with_prompt, add_special_tokens=False).ids, ids[0], ids[1]

    def _render(self, messages: list, where: str, generation: bool = False) -> str:
        with self.template._failures(where), budget():
            return self.template.render(messages, add_generation_prompt=generation)


def prompt_budget(data: DataConfig, seq_len: int) -> int:
    return data.max_prompt_len or max(1, seq_len // 2)


def build_pairs(data: DataConfig, *, path: str, seq_len: int, vocab_size: int, seed: int, log=print) -> "PairRows":
    """The trainable pairs of `path`, skipped records counted and summed up in one line; a ConfigError naming
    the file and line of the first record when none is left."""
    if data.max_prompt_len < 0:
        raise ConfigError(f"data.max_prompt_len: {data.max_prompt_len} must be >= 0 (0: half of train.seq_len)")
    maker, budget = PairMaker(data, vocab_size), prompt_budget(data, seq_len)
    records = read_records(data.kind, record_files(data.kind, path))
    pairs, skipped, first_skip = [], {k: 0 for k in SKIPS}, None
    for record, where in records:
        made = maker(record, where)
        if isinstance(made, tuple):
            made = _truncated(made, budget, seq_len)
        if isinstance(made, str):
            skipped[made] += 1
            first_skip = first_skip or (where, made)
            continue
        pairs.append(made)
    if not pairs:
        where, why = first_skip
        raise ConfigError(f"data.path: {where}: no trainable pair in {path} (every record skipped; the first for "
                          f"{SKIPS[why]}: fields {', '.join(FIELDS)}, train.seq_len={seq_len}, prompt budget "
                          f"{budget})")
    stats = {"pairs": len(pairs), "records": len(records), **{f"skipped_{k}": v for k, v in skipped.items()},
             "cut": sum(int(cut) for *_, cut in pairs)}
    unpacked = "" if data.packing == "none" else f"; data.packing={data.packing} does not pack pairs (a row each)"
    log(pairs_summary(stats) + unpacked)
    tokenizer = maker.tokenizer
    return PairRows([p[:3] for p in pairs], seq_len, seed, stats,
                    decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def _truncated(pair, budget: int, seq_len: int):
    """(prompt, chosen, rejected, whether a completion was cut) within the row, or a SKIPS key."""
    prompt, chosen, rejected = pair
    if len(prompt) > budget:
        return "long_prompt"
    room = seq_len + 1 - len(prompt)  # a sequence of L tokens fills L - 1 positions
    if min(len(chosen), len(rejected), room) < 1:
        return "empty"
    return prompt, chosen[:room], rejected[:room], max(len(chosen), len(rejected)) > room


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
