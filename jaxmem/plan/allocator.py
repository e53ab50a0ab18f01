"""XLA's GPU allocator settings a run needs, derived from its plan.

The trap: XLA's GPU client takes `XLA_PYTHON_CLIENT_MEM_FRACTION` (0.75 when unset) of the GPU's memory
and caps every allocation there, preallocating it unless `XLA_PYTHON_CLIENT_PREALLOCATE=false`. A step that
the plan says needs more than that share of the GPU then runs out of memory at the cap. `jaxmem train` and
`jaxmem bench` derive the settings from the plan before the backend starts: preallocation off, and a
fraction that covers the plan's device total (its step's, or its init's where larger) plus `target.headroom`,
never below XLA's default and never above `MAX_FRACTION`. The device total is the compiled one for this
config and GPU: from the plan cache (`jaxmem plan` writes it there, keyed by the config hash and topology),
else from a deviceless compile in a subprocess (cached in turn), else, if that fails, the analytic bill,
labeled as such. Whatever the user exported wins; a one-line warning says when it cannot hold the plan.
`XLA_PYTHON_CLIENT_ALLOCATOR=platform` (allocate on demand, no pool) has no cap.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping
from jaxmem.config.schema import config_hash, dump_yaml
from jaxmem.plan.bill import compute_bill
from jaxmem.config.targets import TARGETS, target_for_device_kind
from jaxmem.config.validate import fixed_mesh_size
from jaxmem.io.no_follow import write_text

DEFAULT_FRACTION = 0.75  # XLA's XLA_PYTHON_CLIENT_MEM_FRACTION when unset
# The highest fraction the GPU runs used (the rest is left to the CUDA context and library workspaces outside
# XLA's pool: benchmarks/constants.md, allocator).
MAX_FRACTION = 0.95
ENV_KEYS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    env: dict[str, str]  # the variables the run uses (set by jaxmem or by the user)
    set_by_jaxmem: tuple[str, ...]
    limit_bytes: int | None  # what XLA's pool may hold (None: no cap, the platform allocator)
    plan_bytes: int
    plan_how: str
    hbm_bytes: int
    warning: str | None

    def export_lines(self) -> list[str]:
        return [f"export {k}={v}" for k, v in self.env.items()]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "set_by_jaxmem": list(self.set_by_jaxmem),
                "export": self.export_lines()}


def derive(plan_bytes: int, hbm_bytes: int, headroom: float, plan_how: str,
           environ: Mapping[str, str] | None = None) -> AllocatorSettings:
    """The settings for a step that needs `plan_bytes` per device on a GPU of `hbm_bytes`."""
    environ = os.environ if environ is None else environ
    user = {k: environ[k] for k in ENV_KEYS if k in environ}
    wanted = round(min(MAX_FRACTION, max(DEFAULT_FRACTION, plan_bytes / hbm_bytes + headroom)), 3)
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{wanted:g}", **user}
    ours = tuple(k for k in env if k not in user)
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR") == "platform":
        return AllocatorSettings(env, ours, None, plan_bytes, plan_how, hbm_bytes, None)
    try:
        fraction = float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"])
    except ValueError:
        fraction = DEFAULT_FRACTION  # XLA ignores a value it cannot parse; say so below
    limit = int(fraction * hbm_bytes)
    warning = None
    need = f"the plan needs {plan_bytes / GIB:.1f} GiB per device ({plan_how})"
    if plan_bytes > limit and "XLA_PYTHON_CLIENT_MEM_FRACTION" in user:
        warning = (f"XLA_PYTHON_CLIENT_MEM_FRACTION={user['XLA_PYTHON_CLIENT_MEM_FRACTION']} lets XLA use "
                   f"{limit / GIB:.1f} GiB of {hbm_bytes / GIB:.1f} GiB, but {need}: export "
                   f"XLA_PYTHON_CLIENT_MEM_FRACTION={wanted:g} or unset it")
    elif plan_bytes > limit:
        warning = (f"{need}, more than XLA may take ({MAX_FRACTION} x {hbm_bytes / GIB:.1f} GiB = "
                   f"{limit / GIB:.1f} GiB): the run will not fit; see `jaxmem plan` for levers")
    return AllocatorSettings(env, ours, limit, plan_bytes, plan_how, hbm_bytes, warning)


def attached_gpus() -> tuple[int, int, str] | None:
    """(number of GPUs, memory of GPU 0 in bytes, its name) from nvidia-smi, before any backend starts."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        mib, name = out[0].split(",", 1)
        return len(out), int(float(mib) * 2**20), name.strip()
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def cache_dir() -> Path:
    """Where `jaxmem plan` keeps compiled totals by config hash (`JAXMEM_PLAN_CACHE`; empty or unset: the
    default, never the working directory)."""
    return Path(os.environ.get("JAXMEM_PLAN_CACHE") or Path.home() / ".cache" / "jaxmem" / "plans")


def run_peak(plan: dict) -> int:
    """A compiled plan's device bytes for the run: the step's, or the step-0 state's build where larger."""
    return plan.get("device_need_bytes") or plan["compiled"]["device_total"]


def remember(plan: dict) -> None:
    """Keeps a compiled plan's device total under its config hash (`jaxmem plan` calls this)."""
    if plan.get("compiled"):
        path = cache_dir() / f"{plan['config_hash']}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"device_total": run_peak(plan), "label": plan["compiled"]["label"]}))
        except OSError:
            pass  # a read-only home: the next run compiles again


def compiled_device_total(cfg, target: str, n_devices: int, run=subprocess.run) -> tuple[int, str] | None:
    """(compiled device bytes per device, how) for `cfg` on `n_devices` x `target`: from the cache, else a
    deviceless compile in a subprocess (`jaxmem plan --json`, cached); None when that fails."""
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, name=target, gpus_per_host=n_devices,
                                                              hosts=1))
    path = cache_dir() / f"{config_hash(cfg, f'{n_devices} x {target}')}.json"
    if path.exists():
        hit = json.loads(path.read_text())
        return hit["device_total"], f"{hit['label']}, cached by jaxmem plan"
    with tempfile.TemporaryDirectory() as tmp:
        config, out = Path(tmp, "config.yaml"), Path(tmp, "plan.json")
        dump_yaml(cfg, config)
        try:
            run([sys.executable, "-m", "jaxmem.cli", "plan", str(config), "--json", str(out)],
                env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return None
        if not out.exists():
            return None
        plan = json.loads(out.read_text())
    if not plan.get("compiled"):
        return None
    plan["config_hash"] = path.stem  # the run's own key (the config file path differs, not the config)
    remember(plan)
    return run_peak(plan), plan["compiled"]["label"]


def settings_for_run(cfg, environ: Mapping[str, str] | None = None) -> AllocatorSettings | None:
    """The settings for `cfg` on the GPUs of this machine, or None when there is no GPU to set them for
    (JAX_PLATFORMS without cuda/gpu, or no NVIDIA driver). The plan's device total is the analytic bill's
    for the config's target (or the attached GPU's memory), labeled as such."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return None
    attached = attached_gpus()
    target = TARGETS.get(cfg.target.name) or (attached and target_for_device_kind(attached[2]))
    hbm = attached[1] if attached else target and target.hbm_bytes
    if not hbm:
        return None
    local = attached[0] if attached else (cfg.target.gpus_per_host or 1)
    n_devices = fixed_mesh_size(cfg.parallel) or local * max(1, cfg.distributed.num_processes or 1)
    found = compiled_device_total(cfg, target.name, n_devices) if target and n_devices == local else None
    if found is None:  # no target to compile for, several hosts, or the compile failed
        found = compute_bill(cfg, n_devices, gpu=True).device_total, "estimated (analytic)"
    return derive(found[0], hbm, cfg.target.headroom, found[1], environ)


def apply(settings: AllocatorSettings, environ=None) -> None:
    """Sets the variables jaxmem chose (never the user's) in the environment the backend will read."""
    environ = os.environ if environ is None else environ
    for key in settings.set_by_jaxmem:
        environ[key] = settings.env[key]


def prepare(cfg, command: str, out_dir=None, file=None) -> AllocatorSettings | None:
    """Derives and applies the settings before the backend starts; prints them as export lines (and any
    warning) and writes `<out_dir>/allocator.json`. Returns None where there is no GPU to set them for."""
    from jax._src import xla_bridge

    file = file or sys.stderr
    settings = settings_for_run(cfg)
    if settings is None:
        return None
    if xla_bridge.backends_are_initialized():
        print(f"jaxmem {command}: the backend already started; allocator settings left as they are: "
              f"{' '.join(settings.export_lines())} (derived from the plan)", file=file)
        return settings
    apply(settings)
    ours = {k: settings.env[k] for k in settings.set_by_jaxmem}
    told = "; ".join(f"{k}={v}" for k, v in ours.items()) or "nothing (your environment holds the plan)"
    print(f"jaxmem {command}: allocator: set {told} for {settings.plan_bytes / GIB:.1f} GiB per device "
          f"({settings.plan_how}); as exports: {'; '.join(settings.export_lines())}", file=file)
    if settings.warning:
        print(f"jaxmem {command}: warning: {settings.warning}", file=file)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_text(Path(out_dir) / "allocator.json", json.dumps(settings.to_json(), indent=2) + "\n")  # no link
    return settings
