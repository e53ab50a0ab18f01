"""A Jinja sandbox whose renders end within a time and size budget, so a chat template cannot hang a run.

jinja2's ImmutableSandboxedEnvironment keeps a template from touching the host but not from running long or
building huge strings: nested `range` loops run for hours and `'x' * 4000000000` allocates gigabytes in one
C call. Here every place a template can spend time or memory is checked against the render's Budget:

- each `{% for %}` iterates through a guard that checks the clock per item (loops without any call inside
  would otherwise never reach a hook);
- calls (functions, methods, macros) and filters check the clock, refuse integer arguments above
  SIZE_LIMIT (`center(4000000000)`, `ljust`, `indent`) and format widths of that size;
- `*`, `**`, `+`, `%` and `~` refuse a result over SIZE_LIMIT before building it;
- the output is gathered chunk by chunk and stops at SIZE_LIMIT characters.

A breach raises TemplateBudgetError (a jinja2 TemplateError) with a one-line reason; the caller names the
template and the record.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
import re
import time

SIZE_LIMIT = 10_000_000  # characters of output, of any string or sequence a template builds, of an int argument
SECONDS_LIMIT = 10.0  # wall-clock seconds per record (all the renders one record needs)

_budget: contextvars.ContextVar["Budget | None"] = contextvars.ContextVar("jaxmem_template_budget", default=None)
_WIDE_FORMAT = re.compile(r"\d{%d,}" % len(str(SIZE_LIMIT)))  # a width or precision of SIZE_LIMIT or more


class Budget:
    """The deadline of one record's renders; `check()` raises once it has passed."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise budget_error(f"rendering took longer than {self.seconds:g} s")


@functools.lru_cache(maxsize=1)
def _error_class():
    """TemplateBudgetError, built on first use: jinja2 is an optional dependency."""
    from jinja2.exceptions import TemplateError

    class TemplateBudgetError(TemplateError):
        """A render ran past its Budget (time or size); the message is one line."""

    return TemplateBudgetError


def budget_error(reason: str) -> Exception:
    return _error_class()(reason)


@contextlib.contextmanager
def budget(seconds: float | None = None):
    """Renders inside the block share one Budget (default SECONDS_LIMIT, read at entry)."""
    token = _budget.set(Budget(SECONDS_LIMIT if seconds is None else seconds))
    try:
        yield
    finally:
        _budget.reset(token)


def _check_clock() -> None:
    current = _budget.get()
    if current is not None:
        current.check()


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_size(size: int, what: str) -> None:
    if size > SIZE_LIMIT:
        raise budget_error(f"{what} would hold {size:,} items or characters, over the limit of {SIZE_LIMIT:,}")


def _check_arguments(args, kwargs, what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > SIZE_LIMIT:
            raise budget_error(f"{what} was given {value:,}, over the limit of {SIZE_LIMIT:,}")


def _check_format(text, what: str) -> None:
    if isinstance(text, str) and _WIDE_FORMAT.search(text) and ("%" in text or "{" in text):
        raise budget_error(f"{what} has a format width of {SIZE_LIMIT:,} or more")


def _multiply(left, right):
    for sequence, count in ((left, right), (right, left)):
        size = _size(sequence)
        if size is not None and isinstance(count, int):
            _check_size(size * max(count, 0), "a repeated string or list")
    return operator.mul(left, right)


def _power(left, right):
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        _check_size(int(right * math.log2(abs(left)) / 8), "a power")  # bytes of the integer result
    return operator.pow(left, right)


def _add(left, right):
    sizes = (_size(left), _size(right))
    if None not in sizes:
        _check_size(sum(sizes), "a concatenation")
    return operator.add(left, right)


def _modulo(left, right):
    _check_format(left, "a %-format")
    return operator.mod(left, right)


def _checked_result(value, what: str):
    size = _size(value)
    if size is not None:
        _check_size(size, what)
    return value


def guarded_filter(name: str, function):
    """`function` as a filter that checks the clock, its integer arguments and its result's size."""
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def guarded(*args, **kwargs):
        _check_clock()
        _check_arguments(args, kwargs, f"filter {name}")
        if name == "format" and args:  # `"%s"|format(x)`: the value is the format string
            _check_format(args[0], "filter format")
        return _checked_result(function(*args, **kwargs), f"filter {name}'s result")

    return guarded


def _loop(iterable):
    """The guard every `{% for %}` iterates through: the clock is checked before each item."""
    for item in iterable:
        _check_clock()
        yield item


def bounded_environment(**options):
    """An ImmutableSandboxedEnvironment (with `options`) whose renders are bounded as the module says; render
    with `render_bounded`."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCode(CodeGenerator):
        def visit_Template(self, node, frame=None):
            for loop in node.find_all(nodes.For):  # before the filters are collected: the guard is one of them
                loop.iter = nodes.Filter(loop.iter, "_jaxmem_loop", [], [], None, None, lineno=loop.lineno)
            super().visit_Template(node, frame)

        def visit_Concat(self, node, frame):  # `~`: its pieces joined with the size checked
            self.write("environment.bounded_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCode
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.binop_table.update({"*": _multiply, "**": _power, "+": _add, "%": _modulo})

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own naming)
            _check_clock()
            _check_arguments(args, kwargs, f"{getattr(__obj, '__name__', 'a call')}()")
            target = getattr(__obj, "__wrapped__", __obj)
            if getattr(target, "__name__", "") in ("format", "format_map"):
                _check_format(getattr(target, "__self__", None), "a format string")
            return _checked_result(super().call(__context, __obj, *args, **kwargs), "a call's result")

        @staticmethod
        def bounded_join(pieces) -> str:
            pieces = [str(piece) for piece in pieces]
            _check_size(sum(map(len, pieces)), "a ~ concatenation")
            return "".join(pieces)

    env = BoundedEnvironment(**options)
    env.filters = {name: guarded_filter(name, f) for name, f in env.filters.items()}
    env.filters["_jaxmem_loop"] = _loop
    return env


def render_bounded(template, **context) -> str:
    """`template.render(**context)` gathered chunk by chunk, stopping at SIZE_LIMIT characters."""
    chunks, total = [], 0
    for chunk in template.generate(**context):
        total += len(chunk)
        _check_size(total, "the rendered text")
        chunks.append(chunk)
    return "".join(chunks)
