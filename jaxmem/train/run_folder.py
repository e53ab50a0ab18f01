"""The run's folder is the run's: out_dir is new, empty, or a jaxmem run's, never the config file's own folder.

A run writes only these names into out_dir; a folder holding anything else belongs to someone else, and a
run there could write over a user's file (a config.yaml beside its notes) or mix its outputs with theirs.
"""
from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import yaml

from jaxmem.config.schema import ConfigError
from jaxmem.config.validate import require_out_dir
from jaxmem.io.no_follow import link_refused

RESOLVED_CONFIG = "config.resolved.yaml"
LEGACY_CONFIG = "config.yaml"  # what runs wrote before the resolved config got its own name
RUN_ENTRIES = (".jaxmem.lock", RESOLVED_CONFIG, "metrics.jsonl", "checkpoints", "tensorboard", "wandb",
               "allocator.json", "oom_report.json", "memory_profile_step*.prof",
               "reference_logps.*",  # stored reference log-probs (jaxmem.preference.precompute)
               "samples.jsonl")  # a GRPO run's completions (jaxmem.train.rl_loop)


def _a_run_entry(name: str, names: set[str]) -> bool:
    if name == LEGACY_CONFIG:  # an older run's resolved config: only beside that run's other outputs
        return bool(names & {"checkpoints", "metrics.jsonl"})
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in RUN_ENTRIES)


def resolved_config(run_dir: str | Path) -> Path:
    """The resolved config a run wrote into its folder (an older run's config.yaml where that is all it has)."""
    run_dir = Path(run_dir)
    new = run_dir / RESOLVED_CONFIG
    return new if new.is_file() or not (run_dir / LEGACY_CONFIG).is_file() else run_dir / LEGACY_CONFIG


def _writable_ancestor(path: Path) -> tuple[Path, bool]:
    """The nearest existing folder at or above `path`, and whether this process may create entries in it."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    return probe, probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)


def check_out_dir(out_dir: str | Path, config_path: str | Path | None = None) -> None:
    """Raises a one-line ConfigError unless out_dir may hold this run's outputs (see the module's docstring)."""
    require_out_dir(out_dir)
    out = Path(out_dir).absolute()
    if config_path is not None and Path(config_path).absolute().resolve().parent == out.resolve():
        raise ConfigError(f"out_dir: {out} is the folder of the config file {Path(config_path).name}; a run "
                          "writes its outputs into out_dir: name a folder of its own (e.g. out_dir=runs/NAME)")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out_dir: {out} is a file; name a folder (new, empty, or a jaxmem run's)")
    if out.is_dir():
        try:
            names = {entry.name for entry in out.iterdir()}
        except OSError as e:
            raise ConfigError(f"out_dir: {out} cannot be read ({e.strerror})") from None
        foreign = sorted(name for name in names if not _a_run_entry(name, names))
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise ConfigError(f"out_dir: {out} holds files that are not a jaxmem run's ({shown}); name a new or "
                              "empty folder, or a jaxmem run's to resume it")
        linked = sorted(name for name in names if (out / name).is_symlink())
        if linked:  # the run would write through it, over the file or folder it points to
            raise link_refused(f"out_dir: {out / linked[0]}")
    where, ok = _writable_ancestor(out)
    if not ok:
        what = "is not a folder" if not where.is_dir() else "is not writable"
        raise ConfigError(f"out_dir: {out} cannot be written: {where} {what}")


def saved_steps(out_dir: str | Path) -> list[int]:
    """The finalized checkpoint steps under out_dir/checkpoints (orbax gives a step folder its number only once
    it is complete), read from the folder names alone."""
    folder = Path(out_dir) / "checkpoints"
    try:
        return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
    except OSError:
        return []


def check_checkpointless_run(out_dir: str | Path) -> None:
    """A run with checkpoint.enabled=false starts at step 0, and its metrics.jsonl would be cut back to step 0:
    refused (one line) in a folder whose checkpoints still cover later steps."""
    steps = saved_steps(out_dir)
    if steps:
        raise ConfigError(f"checkpoint.enabled=false: {Path(out_dir) / 'checkpoints'} holds a run saved up to step "
                          f"{steps[-1]}, whose metrics.jsonl a run without checkpoints would cut back to step 0; set "
                          "checkpoint.enabled=true to resume it, or use a new out_dir")


# What a finished run was trained on: a rerun with other values here would describe it wrongly
# (config.resolved.yaml is what export-hf ships the tokenizer and model from).
IDENTITY_KEYS = ("model.", "data.", "lora.", "checkpoint.init_from")
_BOOKKEEPING = ("data.workers", "data.cache_dir")  # how the records are read, not which


def _dotted(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_identity(out_dir: str | Path, config: dict) -> list[str]:
    """The model / data / lora / checkpoint.init_from keys whose values in `config` (a resolved config as a dict)
    differ from those in out_dir's resolved config; [] when there is none to compare with."""
    try:
        saved = yaml.safe_load(resolved_config(out_dir).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return []
    if not isinstance(saved, dict):
        return []
    old, new = _dotted(saved), _dotted(config)
    return sorted(key for key in new.keys() & old.keys()
                  if key.startswith(IDENTITY_KEYS) and key not in _BOOKKEEPING and new[key] != old[key])
