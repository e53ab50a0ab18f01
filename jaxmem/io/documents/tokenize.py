"""Records to token documents: ids and a mask of the ids the loss trains on, one document per record.

The result is a token stream (`ids`, `trained`) with document boundaries (`offsets`, n_documents + 1).
Large inputs are tokenized in `data.workers` spawned processes over chunks of records; the result is the
same as in-process tokenization (chunks are concatenated in record order).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.config.schema import CHAT_ROLES, ConfigError, DataConfig

IN_PROCESS_BELOW = 512  # records: fewer are tokenized without starting worker processes
_CHUNK = 256  # records per worker task


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything a (worker) process needs to turn payloads into documents; picklable."""
    tokenizer_json: str
    format: str
    train_on: str
    bos_token: str | None
    eos_token: str | None
    template_text: str | None
    template_origin: str


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_tokenizer(path: str):
    if not path:
        raise ConfigError("data.tokenizer: required for record kinds (jsonl, parquet, hf); give a tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer: needs the `tokenizers` package; pip install 'jaxmem[data]' "
                          "(tokenizers, jinja2 for chat templates, pyarrow for parquet)") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.tokenizer: {path} is not a tokenizer.json ({first})") from None


def tokenizer_spec(data: DataConfig, vocab_size: int) -> tuple[TokenizerSpec, list[bytes]]:
    """The spec of `data`'s tokenizer and template, checked; plus the bytes that decide the tokens (for the cache)."""
    tokenizer = load_tokenizer(data.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > vocab_size:
        raise ConfigError(f"data.tokenizer: {data.tokenizer} has {vocab} tokens > model.vocab_size={vocab_size}; "
                          "use a tokenizer within the vocabulary or raise model.vocab_size")
    config_file = Path(data.tokenizer).parent / "tokenizer_config.json"
    config: dict = {}
    if config_file.exists():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
            raise ConfigError(f"data.tokenizer: {config_file} is not valid JSON ({reason})") from None
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    for name, token in (("eos_token", eos), ("bos_token", bos)):
        if token is not None and tokenizer.token_to_id(token) is None:
            raise ConfigError(f"data.tokenizer: {config_file} names {name} {token!r}, which {data.tokenizer} "
                              "does not have")
    text, origin = _template(data, config, config_file)
    spec = TokenizerSpec(data.tokenizer, data.format, data.train_on, bos, eos, text, origin)
    if data.format == "messages":
        ChatTemplate(text, origin, bos, eos)  # a syntax error is a ConfigError now, not in a worker
    decided_by = [Path(data.tokenizer).read_bytes(), config_file.read_bytes() if config_file.exists() else b"",
                  (text or "").encode()]
    return spec, decided_by


def _template(data: DataConfig, config: dict, config_file: Path) -> tuple[str | None, str]:
    if data.chat_template:
        try:
            return Path(data.chat_template).read_text(encoding="utf-8"), f"data.chat_template: {data.chat_template}"
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"data.chat_template: {data.chat_template} cannot be read ({e})") from None
    jinja_file = config_file.parent / "chat_template.jinja"  # where newer transformers save it
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8"), f"data.tokenizer: {jinja_file}"
    text = config.get("chat_template")
    if isinstance(text, list):  # the older list of named templates: the default one renders chats
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if data.format == "messages" and not isinstance(text, str):
        raise ConfigError(f"data.chat_template: data.format=messages needs a chat template and {config_file} has "
                          "none; set data.chat_template to a Jinja file")
    return (text if isinstance(text, str) else None), f"data.tokenizer: {config_file} chat_template"


def payloads(data: DataConfig, records: list[tuple[dict, str]]) -> tuple[list[tuple[Any, str]], int]:
    """(the fields each record's document is made of, with where the record was read; the number of records
    skipped because their messages are empty). A missing field is a ConfigError naming its key."""
    fields = {"text": ("text_field",), "prompt_completion": ("prompt_field", "completion_field"),
              "messages": ("messages_field",)}[data.format]
    out, skipped = [], 0
    for number, (record, where) in enumerate(records, 1):
        values = []
        for key in fields:
            name = getattr(data, key)
            value = record.get(name)
            if value is None:
                raise ConfigError(f"data.{key}: record {number} ({where}) has no {name!r}; "
                                  f"its fields are {', '.join(map(repr, record)) or 'none'}")
            expected = list if key == "messages_field" else str
            if not isinstance(value, expected):
                raise ConfigError(f"data.{key}: record {number} ({where}) has {name!r} of type "
                                  f"{type(value).__name__}; expected a {expected.__name__}")
            if key == "messages_field":
                value = _turns(value, f"data.{key}: record {number} ({where})", data.roles or {})
            values.append(value)
        if data.format == "messages" and not values[0]:
            skipped += 1  # a chat without turns has nothing to train on (counted in the packing summary)
            continue
        out.append((values, f"record {number} ({where})"))
    return out, skipped


def _turns(turns: list, what: str, roles: dict) -> list[dict]:
    """The turns with their roles renamed by `roles` (data.roles) and multi-part content ([{"type": "text",
    "text": ...}, ...]) joined into one string. A role the templates do not know is refused: its turn would
    render as the template pleases, and an assistant turn misspelled is silently not trained on."""
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise ConfigError(f"{what} turn {i} is not a mapping with a 'role' (and 'content')")
        role = roles.get(turn["role"], turn["role"])
        if role not in CHAT_ROLES:
            raise ConfigError(f"{what} turn {i} has role {turn['role']!r}; use one of {', '.join(CHAT_ROLES)}, "
                              f"or map it with data.roles (e.g. 'data.roles={{{turn['role']}: assistant}}')")
        if role != turn["role"]:
            turn = dict(turn, role=role)
        if "content" in turn and turn["content"] is None:  # a template's `+` on None is a jinja traceback
            raise ConfigError(f"{what} turn {i} ({turn['role']}) has content null; give a string (\"\" for "
                              "an empty turn) or leave the turn out")
        if isinstance(turn.get("content"), list):
            turn = dict(turn, content=_joined_parts(turn["content"], f"{what} turn {i} ({turn['role']})"))
        out.append(turn)
    return out


def _joined_parts(parts: list, what: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ConfigError(f"{what} content part {j} is {kind!r}, not text; only {{\"type\": \"text\", "
                              "\"text\": ...} parts are read: leave the others out")
        texts.append(part["text"])
    return "".join(texts)


class DocumentMaker:
    """Turns payloads into (ids, trained) with one tokenizer and template."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self.tokenizer = load_tokenizer(spec.tokenizer_json)
        self.eos = [] if spec.eos_token is None else [self.tokenizer.token_to_id(spec.eos_token)]
        self.template = (ChatTemplate(spec.template_text, spec.template_origin, spec.bos_token, spec.eos_token)
                         if spec.format == "messages" else None)

    def __call__(self, values: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        train_all = self.spec.train_on == "all"
        if self.spec.format == "text":
            ids = self.tokenizer.encode(values[0], add_special_tokens=True).ids + self.eos
            trained = [True] * len(ids)
        elif self.spec.format == "prompt_completion":
            prompt = self.tokenizer.encode(values[0], add_special_tokens=True).ids
            completion = self.tokenizer.encode(values[1], add_special_tokens=False).ids + self.eos
            ids = prompt + completion
            trained = [train_all] * len(prompt) + [True] * len(completion)
        else:
            ids, trained = self._chat(values[0], where, train_all)
        return np.asarray(ids, np.int32), np.asarray(trained, np.bool_)

    def _chat(self, messages: list[dict], where: str, train_all: bool):
        if train_all:
            encoding = self.tokenizer.encode(self.template.render_checked(messages, where), add_special_tokens=False)
            return encoding.ids, [True] * len(encoding.ids)
        text, spans = self.template.render_with_assistant_spans(messages, where)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        inside = np.zeros(len(text) + 1, np.bool_)
        for start, stop in spans:
            inside[start:stop] = True
        starts = np.asarray([start for start, _ in encoding.offsets], np.int64).reshape(-1)
        return encoding.ids, inside[np.minimum(starts, len(text))]


_worker_maker: DocumentMaker | None = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _worker_maker
    _worker_maker = DocumentMaker(spec)


def _tokenize_chunk(chunk: list[tuple[Any, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [_worker_maker(values, where) for values, where in chunk]


def tokenize_documents(spec: TokenizerSpec, items: list[tuple[Any, str]], workers: int) -> dict[str, np.ndarray]:
    """{"ids", "trained", "offsets"}: every payload's document, concatenated in order."""
    workers = workers or min(os.cpu_count() or 1, 8)
    if workers == 1 or len(items) < IN_PROCESS_BELOW:
        maker = DocumentMaker(spec)
        documents = [maker(values, where) for values, where in items]
    else:
        chunks = [items[i:i + _CHUNK] for i in range(0, len(items), _CHUNK)]
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                 initargs=(spec,)) as pool:
            documents = [doc for done in pool.map(_tokenize_chunk, chunks) for doc in done]
    lengths = np.asarray([len(ids) for ids, _ in documents], np.int64)
    return {"ids": np.concatenate([ids for ids, _ in documents]).astype(np.int32),
            "trained": np.concatenate([trained for _, trained in documents]).astype(np.bool_),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)}
