"""What a Hugging Face folder needs beside its weights to be used alone: the run's tokenizer files, the special
token ids in config.json, and generation_config.json whose eos ids include the chat template's end-of-turn
token (so `generate` stops at the end of an assistant turn, not only at the tokenizer's eos).

Written by `jaxmem export-hf` and `jaxmem merge-lora` (jaxmem.cli.export_hf, jaxmem.lora.export).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from jaxmem.config.schema import Config, ConfigError
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.io.documents.tokenize import load_tokenizer

_SENTINEL = "JAXMEMSENTINELTURN"
_COPIED = ("special_tokens_map.json", "added_tokens.json")


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template(cfg: Config, tok_config: dict, tok_dir: Path) -> str | None:
    """The chat template the run trained with: data.chat_template, else chat_template.jinja, else the config's."""
    if cfg.data.chat_template:
        return Path(cfg.data.chat_template).read_text(encoding="utf-8")
    if (tok_dir / "chat_template.jinja").is_file():
        return (tok_dir / "chat_template.jinja").read_text(encoding="utf-8")
    text = tok_config.get("chat_template")
    if isinstance(text, list):  # the older list of named templates
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    return text if isinstance(text, str) else None


def end_of_turn_id(tokenizer, template: str, bos: str | None, eos: str | None) -> int | None:
    """The first special token the template writes after an assistant turn's text (<|im_end|>, <|eot_id|>)."""
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = ChatTemplate(template, "chat template", bos, eos).render(chat)
    except Exception:  # a template that needs other roles or fields: no end-of-turn token to name
        return None
    if _SENTINEL not in text:
        return None
    tail = text.split(_SENTINEL, 1)[1]
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return next((i for i in tokenizer.encode(tail, add_special_tokens=False).ids if i in special), None)


def special_ids(cfg: Config) -> dict:
    """bos / eos / pad ids of the run's tokenizer and the eos ids generation should stop at; {} without one."""
    if not cfg.data.tokenizer:
        return {}
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    tok_dir = Path(cfg.data.tokenizer).parent
    tok_config = _read_config(tok_dir)
    names = {k: _token_text(tok_config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
    ids = {k: (tokenizer.token_to_id(v) if v is not None else None) for k, v in names.items()}
    template = _template(cfg, tok_config, tok_dir)
    turn_end = end_of_turn_id(tokenizer, template, names["bos"], names["eos"]) if template else None
    stop = [i for i in (ids["eos"], turn_end) if i is not None]
    return {"bos": ids["bos"], "eos": ids["eos"], "pad": ids["pad"], "stop": list(dict.fromkeys(stop)),
            "template": template, "tokenizer": tokenizer}


def _read_config(tok_dir: Path) -> dict:
    path = tok_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.tokenizer: {path} is not valid JSON ({e})") from None
    return value if isinstance(value, dict) else {}


def write_companions(cfg: Config, out: str | Path) -> str:
    """Writes the tokenizer files and generation_config.json into `out` (which holds config.json already) and
    adds the special token ids to config.json; returns a one-line account of what was written."""
    out = Path(out)
    ids = special_ids(cfg)
    hf_cfg = json.loads((out / "config.json").read_text())
    if not ids:
        return ("no tokenizer in this run (data.tokenizer is empty): the folder holds weights and config.json; "
                "copy the tokenizer files into it")
    tok_dir = Path(cfg.data.tokenizer).parent
    shutil.copyfile(cfg.data.tokenizer, out / "tokenizer.json")
    for name in _COPIED:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    tok_config = _read_config(tok_dir)
    tok_config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")  # tokenizer.json as is
    if ids["template"] is not None:
        tok_config["chat_template"] = ids["template"]
    tok_config.pop("auto_map", None)  # remote code the folder does not carry
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    pad = ids["pad"] if ids["pad"] is not None else ids["eos"]
    hf_cfg.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=pad)
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    stop = ids["stop"]
    generation = {"bos_token_id": ids["bos"], "eos_token_id": stop[0] if len(stop) == 1 else stop,
                  "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = ids["tokenizer"]
    names = ", ".join(tokenizer.id_to_token(i) for i in stop) or "none"
    return f"tokenizer files, chat template and generation_config.json written; generate stops at {names}"
