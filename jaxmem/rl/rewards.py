"""Reward functions named in rl.rewards (`module:function` or `path.py:function`), TRL's convention:
f(prompts, completions, **fields) -> one float per completion, `fields` the prompt records' other fields, each
a list aligned with the completions. A reference that cannot be imported is a one-line ConfigError at load; a
function that raises, returns the wrong number of values or NaN is a RewardError naming it and the record."""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
from pathlib import Path
from typing import Callable

import numpy as np

from jaxmem.config.schema import ConfigError


class RewardError(RuntimeError):
    """A reward function failed on a rollout (the run saves what it has, then stops)."""


@dataclasses.dataclass(frozen=True)
class Reward:
    name: str  # the function's name, as metrics report it (rewards/<name>/mean)
    ref: str  # the reference as the config wrote it
    fn: Callable
    weight: float


def _load(ref: str) -> Callable:
    where, sep, name = ref.rpartition(":")
    if not sep or not where or not name:
        raise ConfigError(f"rl.rewards: {ref!r} is not module:function or path.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"rl.rewards: {ref!r}: no file {where}")
            spec = importlib.util.spec_from_file_location(f"jaxmem_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # the user's module failed to import: its one-line reason
        raise ConfigError(f"rl.rewards: {ref!r} cannot be imported: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"rl.rewards: {ref!r}: {where} has no function {name}")
    return fn


def parse_weights(text: str, n: int) -> list[float]:
    if not text.strip():
        return [1.0] * n
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(f"rl.reward_weights: {text!r} is not comma-separated numbers") from None
    if len(weights) != n or not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"rl.reward_weights: {len(weights)} finite weights needed one per rl.rewards entry ({n})")
    return weights


def load_rewards(rewards: str, weights: str) -> tuple[Reward, ...]:
    refs = [r.strip() for r in rewards.split(",") if r.strip()]
    if not refs:
        raise ConfigError("rl.rewards: train.objective=grpo needs at least one module:function or path.py:function")
    return tuple(Reward(r.rpartition(":")[2], r, _load(r), w) for r, w in zip(refs, parse_weights(weights, len(refs))))


def score(rewards: tuple[Reward, ...], prompts: list, completions: list[str], records: list[dict]) -> np.ndarray:
    """[N, F] float32: each function's reward per completion; `records` the prompt record of each completion."""
    fields = {k: [r.get(k) for r in records] for k in records[0] if k not in ("prompt", "messages")}
    out = np.zeros((len(completions), len(rewards)), np.float32)
    for j, reward in enumerate(rewards):
        try:
            values = list(reward.fn(prompts=prompts, completions=completions, **fields))
        except Exception as e:
            raise RewardError(f"reward {reward.ref} raised {type(e).__name__}: {e} (on record "
                              f"{_short(records[0])} and the rest of its rollout)") from None
        if len(values) != len(completions):
            raise RewardError(f"reward {reward.ref} returned {len(values)} values for {len(completions)} "
                              f"completions (record {_short(records[0])})")
        try:
            out[:, j] = np.asarray(values, np.float64)
        except (TypeError, ValueError):
            raise RewardError(f"reward {reward.ref} returned values that are not numbers (record "
                              f"{_short(records[0])})") from None
        bad = np.flatnonzero(~np.isfinite(out[:, j]))
        if bad.size:
            raise RewardError(f"reward {reward.ref} returned {out[bad[0], j]} for completion {bad[0]} (record "
                              f"{_short(records[bad[0]])})")
    return out


def _short(record: dict) -> str:
    text = repr(record)
    return text if len(text) <= 120 else text[:117] + "..."
