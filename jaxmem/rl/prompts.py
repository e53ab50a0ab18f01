"""The prompts a GRPO run samples from (rl.prompts, a jsonl file): each record a `prompt` (text, tokenized as
is) or `messages` (a chat, rendered through data.tokenizer's chat template with the generation prompt); the
record's other fields go to the reward functions. Also the run's codec (its tokenizer, template and stop ids)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jaxmem.config.schema import Config, ConfigError
from jaxmem.generation import text
from jaxmem.generation.text import TextCodec


def run_codec(cfg: Config) -> TextCodec:
    """The run's data.tokenizer with its chat template; generation stops at its eos and end-of-turn ids."""
    codec = text.run_codec(cfg)
    if codec is None:
        raise ConfigError("data.tokenizer: train.objective=grpo decodes completions to text for the rewards; set "
                          "data.tokenizer to a tokenizer.json")
    return codec


@dataclasses.dataclass(frozen=True)
class Prompts:
    records: list  # the jsonl records
    ids: list  # each record's prompt tokens

    def __len__(self) -> int:
        return len(self.records)

    def at_rollout(self, rollout: int, per_step: int, seed: int) -> np.ndarray:
        """The record indices of rollout `rollout` (0-based): a permutation per pass over the file, seeded by
        train.seed and the pass, so a resumed run draws the same prompts."""
        n = len(self.records)
        out = []
        for position in range(rollout * per_step, (rollout + 1) * per_step):
            order = np.random.default_rng([seed, position // n]).permutation(n)
            out.append(int(order[position % n]))
        return np.asarray(out)


def read_prompts(cfg: Config, codec: TextCodec) -> Prompts:
    path = Path(cfg.rl.prompts)
    if not path.is_file():
        raise ConfigError(f"rl.prompts: no file {path}")
    records, ids = [], []
    for number, record in text.prompt_lines(path, "rl.prompts"):
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ConfigError(f"rl.prompts: {path} line {number} needs exactly one of prompt (text) or messages")
        tokens = codec.encode(record.get("prompt", record.get("messages")), chat="messages" in record)
        if not 0 < len(tokens) <= cfg.rl.max_prompt_len:
            raise ConfigError(f"rl.prompts: {path} line {number} has {len(tokens)} prompt tokens; rl.max_prompt_len "
                              f"is {cfg.rl.max_prompt_len}")
        records.append(record)
        ids.append(tokens)
    if not records:
        raise ConfigError(f"rl.prompts: {path} holds no prompts")
    return Prompts(records, ids)
