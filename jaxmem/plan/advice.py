"""The advice `jaxmem explain` gives for a buffer, checked against the config it explains: an alternative whose
levers the config already uses, or that the config's validation refuses with them (int8 moments with Adafactor,
cuDNN with attention sinks, ...), is left out. The alternatives per buffer kind: jaxmem.plan.categories."""
from __future__ import annotations

import json
import re

from jaxmem.config.schema import Config, ConfigError, apply_overrides, to_dict
from jaxmem.core import remat
from jaxmem.loader import from_dict
from jaxmem.plan.categories import SUGGESTIONS

# a lever as the alternatives write it: key=value, or key>=value (an int the config's value is at least)
REMAT_NAMES = "remat.names."
LEVER = re.compile(r"\b([a-z_]+(?:\.[a-z_]+)+)(>=|=)([A-Za-z0-9_.\-]+)")


def levers(text: str) -> list[tuple[str, str, str]]:
    """(key, "=" or ">=", value) of each lever an alternative names."""
    return [(m.group(1), m.group(2), m.group(3).rstrip(".")) for m in LEVER.finditer(text)]


def _current(cfg: Config, raw: dict, key: str):
    """The config's value of `key`; for remat.names.<name>, the choice its preset and names resolve to."""
    if key.startswith(REMAT_NAMES):
        return remat.name_choices(cfg.remat).get(key.removeprefix(REMAT_NAMES))
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _same(current, value: str) -> bool:
    return str(current).lower() == value.lower()


def _already_at_least(current, value: str) -> bool:
    try:
        return int(current) >= int(value)
    except (TypeError, ValueError):
        return False


def holds(cfg: Config, raw: dict, named: list[tuple[str, str, str]]) -> bool:
    """Whether the config already uses every lever named (then the alternative tells it nothing)."""
    return all(_already_at_least(_current(cfg, raw, k), v) if op == ">=" else _same(_current(cfg, raw, k), v)
               for k, op, v in named)


def _accepted(raw: dict, named: list[tuple[str, str, str]]) -> bool:
    """Whether the config with these levers set passes the config's validation (jaxmem.loader.from_dict)."""
    try:
        from_dict(apply_overrides(json.loads(json.dumps(raw)), [f"{k}={v}" for k, _, v in named]))
    except (ConfigError, ValueError, TypeError, KeyError):
        return False
    return True


class Advisor:
    """The checked advice for each buffer kind of one config (each alternative validated once)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.raw = to_dict(cfg)
        self._kept: dict[str, bool] = {}

    def keeps(self, alternative: str) -> bool:
        """Whether an alternative is worth showing: it names no lever (prose), or its levers are not all in
        use already and the config accepts them set together."""
        if alternative not in self._kept:
            named = levers(alternative)
            self._kept[alternative] = not named or (not holds(self.cfg, self.raw, named) and _accepted(self.raw, named))
        return self._kept[alternative]

    def alternatives(self, key: str, name: str = "") -> tuple[str, list[str]]:
        """(what the buffer is, the alternatives kept) for explain's `key` and checkpoint `name`."""
        lead, options = SUGGESTIONS[key]
        fields = {"name": name, "param_dtype": self.cfg.precision.param_dtype}
        return lead.format(**fields), [o for o in (opt.format(**fields) for opt in options) if self.keeps(o)]

    def suggestion(self, key: str, name: str = "") -> str:
        """One line: what the buffer is, then each kept alternative."""
        lead, kept = self.alternatives(key, name)
        if not kept:
            return f"{lead}: every lever for it is already set in this config, or refused with it"
        return f"{lead}: {'; '.join(kept)}"


_ADVISORS: dict[str, Advisor] = {}


def advisor_for(cfg: Config) -> Advisor:
    """The Advisor of `cfg`, kept across the buffers of one explain (and its timeline) so each alternative is
    validated once per config."""
    key = json.dumps(to_dict(cfg), sort_keys=True, default=str)
    if key not in _ADVISORS:
        if len(_ADVISORS) > 8:
            _ADVISORS.clear()
        _ADVISORS[key] = Advisor(cfg)
    return _ADVISORS[key]
