"""Chat templates rendered the way Hugging Face's `apply_chat_template` renders them, and the assistant spans.

The environment matches transformers' chat_template_utils: a sandboxed Jinja environment with
trim_blocks and lstrip_blocks, loop controls, `raise_exception`, a `tojson` filter that does not escape
HTML, `strftime_now`, and `{% generation %}` blocks (rendered as their body). Templates see `messages`,
`bos_token`, `eos_token` and `add_generation_prompt`. Renders are bounded in time and size per record
(jaxmem.io.documents.template_bounds); any failure is a one-line ConfigError naming the template and the record.
"""
from __future__ import annotations

import contextlib
import json
from datetime import datetime
from functools import lru_cache

from jaxmem.config.schema import ConfigError
from jaxmem.io.documents.template_bounds import (budget, bounded_environment, guarded_filter,
                                                        render_bounded)


class _Generation:
    """Lazily built jinja2 extension: `{% generation %}...{% endgeneration %}` renders its body."""

    @staticmethod
    def extension():
        from jinja2 import nodes
        from jinja2.ext import Extension

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        return Generation


def _raise_exception(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(text: str):
    from jinja2.ext import loopcontrols

    env = bounded_environment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_Generation.extension(), loopcontrols])
    env.filters["tojson"] = guarded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


class ChatTemplate:
    """A chat template with its special tokens; `origin` names where it came from in errors."""

    def __init__(self, text: str, origin: str, bos_token: str | None = None, eos_token: str | None = None):
        try:
            from jinja2.exceptions import TemplateSyntaxError
        except ImportError:
            raise ConfigError(f"{origin}: chat templates need the jinja2 package; pip install 'jaxmem[data]' "
                              "(tokenizers, jinja2, pyarrow)") from None

        self.text, self.origin, self.bos_token, self.eos_token = text, origin, bos_token, eos_token
        try:
            self._template = _compile(text)
        except TemplateSyntaxError as e:
            raise ConfigError(f"{origin} is not a valid Jinja template (line {e.lineno}: {e.message})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The rendered chat; a caller bounds a whole record's renders with template_bounds.budget()."""
        return render_bounded(self._template, messages=messages, bos_token=self.bos_token,
                              eos_token=self.eos_token, add_generation_prompt=add_generation_prompt)

    def render_with_assistant_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and the character spans [start, stop) of its assistant turns.

        Turn i's span runs from the end of render(messages[:i], add_generation_prompt=True) (so the role
        header is not in it) to the end of render(messages[:i + 1]) (so the end-of-turn text is).
        """
        with self._failures(where), budget():
            full = self.render(messages)
            spans = []
            for i, message in enumerate(messages):
                if message.get("role") != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                through = self.render(messages[:i + 1])
                for prefix in (before, through):
                    if not full.startswith(prefix):
                        raise ConfigError(
                            f"{self.origin}: rendering the turns before assistant turn {i} of {where} is not a "
                            "prefix of the whole chat, so the assistant tokens cannot be found; use a template "
                            "that renders earlier turns the same way whatever follows, or data.train_on=all")
                if not through.startswith(before):
                    raise ConfigError(f"{self.origin}: the generation prompt before assistant turn {i} of {where} "
                                      "is not how the template renders that turn; use data.train_on=all")
                spans.append((len(before), len(through)))
        return full, spans

    def render_checked(self, messages: list[dict], where: str) -> str:
        with self._failures(where), budget():
            return self.render(messages)

    @contextlib.contextmanager
    def _failures(self, where: str):
        """Whatever a template raises (its own raise_exception, a type error, the budget) as one line naming
        the template and the record; a ConfigError passes through."""
        try:
            yield
        except ConfigError:
            raise
        except Exception as e:  # a template is code: TemplateError, TypeError, RecursionError, MemoryError, ...
            lines = str(e).strip().splitlines()
            reason = lines[0] if lines else type(e).__name__
            if not isinstance(e, _template_error()):
                reason = f"{type(e).__name__}: {reason}"
            raise ConfigError(f"{self.origin}: rendering {where} failed ({reason[:300]})") from None


def _template_error():
    from jinja2.exceptions import TemplateError

    return TemplateError
