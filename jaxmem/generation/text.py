"""Generation from text: a tokenizer (tokenizer.json) and its chat template around the decode loop.

`Generator` holds a decoder and its weights; `complete` tokenizes prompts (a chat rendered through the template
with the generation prompt where asked), buckets the batch's prompt length and the token budget, runs the
compiled loop (one compile per (prompt bucket, budget bucket, sampling)), and decodes each row's new tokens
up to its stop token.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.config.schema import ConfigError
from jaxmem.generation.buckets import batch_bucket, bucket
from jaxmem.generation.decoder import Decoder
from jaxmem.generation.loop import generate_fn, left_pad
from jaxmem.generation.sampling import Sampling
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.io.documents.tokenize import load_tokenizer
from jaxmem.io.hf_companions import special_ids

CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")


@dataclasses.dataclass
class TextCodec:
    """A tokenizer (tokenizers.Tokenizer), its chat template, the ids generation stops at and pads with."""

    tokenizer: object
    template: ChatTemplate | None
    stop_ids: tuple[int, ...]
    pad_id: int

    def encode(self, prompt, chat: bool) -> list[int]:
        if chat:
            if self.template is None:
                raise ConfigError("--chat: the tokenizer has no chat template (tokenizer_config.json "
                                  "chat_template or chat_template.jinja)")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = self.template.render(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if not isinstance(prompt, str):
            raise ConfigError("prompt: a list of messages needs --chat (chat=True)")
        return self.tokenizer.encode(prompt).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.stop_ids])


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def hf_codec(folder: str | Path) -> TextCodec:
    """The codec of a Hugging Face folder: tokenizer.json, the chat template (tokenizer_config.json or
    chat_template.jinja), stop ids from generation_config.json's eos_token_id (else config.json's)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{folder}: no tokenizer.json; generation from text needs the model's tokenizer")
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    tok_config = _json(folder / "tokenizer_config.json")
    template = (folder / "chat_template.jinja").read_text(encoding="utf-8") \
        if (folder / "chat_template.jinja").is_file() else tok_config.get("chat_template")
    bos, eos = _token_text(tok_config.get("bos_token")), _token_text(tok_config.get("eos_token"))
    config, gen_config = _json(folder / "config.json"), _json(folder / "generation_config.json")
    stops = _ids(gen_config.get("eos_token_id", config.get("eos_token_id")))
    if not stops and eos is not None and tokenizer.token_to_id(eos) is not None:
        stops = [tokenizer.token_to_id(eos)]
    pad = gen_config.get("pad_token_id", config.get("pad_token_id"))
    pad = _ids(pad)[0] if _ids(pad) else (stops[0] if stops else 0)
    chat = ChatTemplate(template, f"{folder} chat template", bos, eos) if isinstance(template, str) else None
    return TextCodec(tokenizer, chat, tuple(stops), pad)


@dataclasses.dataclass
class Generator:
    """A decoder, its weights and a codec; batches are padded to their bucket (jaxmem.generation.buckets:
    a power of two, a multiple of `rows_multiple`, the mesh's data ways), so a new batch size within a bucket
    reuses the compiled program."""

    decoder: Decoder
    weights: object
    codec: TextCodec | None
    rows_multiple: int = 1
    _compiled: dict = dataclasses.field(default_factory=dict)

    def complete_ids(self, prompts: list[list[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
                     seed: int = 0, stop_ids=None, cache_dtype: str | None = None) -> list[list[int]]:
        """Each prompt's new token ids, its stop token included where it produced one."""
        check_request(prompts, max_new_tokens, self.decoder.cfg, cache_dtype)
        stops = tuple(self.codec.stop_ids if stop_ids is None and self.codec else (stop_ids or ()))
        pad = self.codec.pad_id if self.codec else 0
        rows = batch_bucket(len(prompts), self.rows_multiple)
        batch = list(prompts) + [prompts[0]] * (rows - len(prompts))  # filler rows, dropped below
        tokens, starts = left_pad(batch, bucket(max(map(len, prompts))), pad)
        key = (bucket(max_new_tokens), sampling, stops, pad, cache_dtype)
        if key not in self._compiled:
            self._compiled[key] = jax.jit(generate_fn(self.decoder, max_new=key[0], sampling=sampling,
                                                      stop_ids=stops, pad_id=pad, cache_dtype=cache_dtype))
        out = self._compiled[key](self.weights, jnp.asarray(tokens), jnp.asarray(starts), jax.random.key(seed),
                                  jnp.int32(max_new_tokens))
        new, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        return [new[row, :lengths[row]].tolist() for row in range(len(prompts))]

    def complete(self, prompts: list, *, chat: bool = False, **kwargs) -> list[str]:
        """Each prompt's completion as text (a prompt: a string, or with `chat` a string or a list of
        {"role", "content"} messages)."""
        if self.codec is None:
            raise ConfigError("generation from text needs a tokenizer (data.tokenizer of the run, or the "
                              "folder's tokenizer.json)")
        ids = [self.codec.encode(p, chat) for p in prompts]
        return [self.codec.decode(row) for row in self.complete_ids(ids, **kwargs)]


def check_request(prompts: list[list[int]], max_new_tokens: int, cfg, cache_dtype) -> None:
    """One-line errors for what the loop cannot run, before any compile."""
    if not prompts:
        raise ConfigError("prompts: none given")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("prompts: an empty prompt (no tokens); every prompt needs at least one")
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens: {max_new_tokens} must be >= 1")
    if cache_dtype is not None and cache_dtype not in CACHE_DTYPES:
        raise ConfigError(f"--cache-dtype: {cache_dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > cfg.max_seq_len:
        raise ConfigError(f"--max-new-tokens: the longest prompt ({longest} tokens) + {max_new_tokens} new tokens "
                          f"exceed the model's max_seq_len {cfg.max_seq_len}")
    bad = [t for p in prompts for t in p if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ConfigError(f"prompts: token id {bad[0]} is outside the vocabulary (0 .. {cfg.vocab_size - 1})")


def run_codec(cfg) -> "TextCodec | None":
    """A run's codec: its data.tokenizer with the chat template, generation stopping at its eos and end-of-turn
    ids; None where the run names no tokenizer."""
    ids = special_ids(cfg)
    if not ids:
        return None
    tokenizer = ids["tokenizer"]
    name = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    template = ChatTemplate(ids["template"], "the run's chat template", name(ids["bos"]), name(ids["eos"])) \
        if ids["template"] else None
    stops = tuple(ids["stop"])
    pad = ids["pad"] if ids["pad"] is not None else (stops[0] if stops else 0)
    return TextCodec(tokenizer, template, stops, pad)


def prompt_lines(path: Path, key: str):
    """(line number, record) of each non-blank line of the JSONL prompts file `path`; a line that is not JSON is
    a one-line ConfigError naming `key` (the flag or config key that gave the file)."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{key}: {path} line {number} is not JSON ({e})") from None
