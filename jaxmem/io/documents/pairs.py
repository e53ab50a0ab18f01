"""Preference pairs (data.format=preference) as rows: with data.packing none the pair's chosen sequence on row
2i, its rejected one on row 2i + 1 (so both always share a micro-batch and a device: train.micro_batch is even),
one sequence per row (jaxmem.io.documents.pair_rows); packed, whole pairs as two segments each of a row
(jaxmem.io.documents.pair_packing).

A record is {"prompt", "chosen", "rejected"}: plain strings (the prompt tokenized with the tokenizer's special
tokens, each completion without them and ended by eos), or TRL's conversational form (prompt a list of
messages, chosen / rejected lists of assistant messages) rendered with the chat template: the prompt as the
chat with the generation prompt, each completion as the rest of the whole chat's rendering. The prompt is
tokenized once and shared by the pair; labels cover the completion's tokens only.

Truncation: a prompt over data.max_prompt_len tokens (0: half of train.seq_len) skips the pair; completions
are cut from the end to fit train.seq_len + 1 tokens (packed: the pair's two sequences to fit one row). Records
missing a field, with chosen equal to rejected, or with a completion empty after the cut are skipped and counted
(`PairRows.stats`).
"""
from __future__ import annotations

from jaxmem.config.schema import ConfigError, DataConfig
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.io.documents.pair_packing import PackedPairRows
from jaxmem.io.documents.pair_rows import REFERENCE_KEY, SKIPS, PairRows  # noqa: F401 (REFERENCE_KEY: re-exported)
from jaxmem.io.documents.reading import read_records, record_files
from jaxmem.io.documents.template_bounds import budget
from jaxmem.io.documents.tokenize import load_tokenizer, tokenizer_spec

FIELDS = ("prompt", "chosen", "rejected")


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
            made = _truncated(made, budget, seq_len, packed=data.packing != "none")
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
    tokenizer = maker.tokenizer
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    if data.packing == "none":
        rows = PairRows([p[:3] for p in pairs], seq_len, seed, stats, decode=decode)
    else:
        rows = PackedPairRows([p[:3] for p in pairs], seq_len, seed, stats, data.packing, decode=decode)
    log(rows.summary())
    return rows


def _truncated(pair, budget: int, seq_len: int, packed: bool = False):
    """(prompt, chosen, rejected, whether a completion was cut) within the row (packed: the whole pair within
    one row), or a SKIPS key."""
    prompt, chosen, rejected = pair
    if len(prompt) > budget:
        return "long_prompt"
    if packed:
        return _truncated_pair(prompt, chosen, rejected, seq_len)
    room = seq_len + 1 - len(prompt)  # a sequence of L tokens fills L - 1 positions
    if min(len(chosen), len(rejected), room) < 1:
        return "empty"
    return prompt, chosen[:room], rejected[:room], max(len(chosen), len(rejected)) > room


def _truncated_pair(prompt, chosen, rejected, seq_len: int):
    """Both sequences in one row of seq_len positions: the completions share seq_len + 2 - 2 x prompt tokens,
    the longer one cut first (to half the room when both are longer)."""
    room = seq_len + 2 - 2 * len(prompt)
    if min(len(chosen), len(rejected)) < 1 or room < 2:
        return "empty"
    if len(chosen) + len(rejected) <= room:
        return prompt, chosen, rejected, False
    half = room // 2
    n_c = len(chosen) if len(chosen) <= half else max(half, room - len(rejected))
    n_r = min(len(rejected), room - n_c)
    return prompt, chosen[:n_c], rejected[:n_r], True
