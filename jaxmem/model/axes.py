"""Logical-axis constraints on activations; the rules come from jaxmem.core.sharding."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax

# A function (x, logical_names) -> x installed by the sharding module while tracing.
_constrainer: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("constrainer", default=None)


@contextlib.contextmanager
def activation_rules(fn: Callable[[jax.Array, tuple], jax.Array]):
    token = _constrainer.set(fn)
    try:
        yield
    finally:
        _constrainer.reset(token)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Names the logical axes of an activation; a no-op outside a sharding context."""
    fn = _constrainer.get()
    return x if fn is None else fn(x, names)
