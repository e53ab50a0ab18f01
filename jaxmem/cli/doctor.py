"""`jaxmem doctor [CONFIG] [key=value ...] [--json FILE]`: is this machine ready to run a config?

One line per check, each ok / warn / fail / skip (skip: cannot be checked here, the detail says why); exit 1
when any check fails. What each check reads and what to do about it: docs/doctor.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Mapping

from jaxmem.plan.allocator import ENV_KEYS as ALLOCATOR_VARS, derive
from jaxmem.runtime.compat import JAX_RANGE, in_range, version_tuple
from jaxmem.runtime.compat import UnsupportedVersion, installed_version, require_matching_cuda_plugin
from jaxmem.kernels import cudnn_present
from jaxmem.kernels.host_adamw.build import BuildError, library_path, register
from jaxmem.runtime.distributed import slurm_tasks
from jaxmem.config.schema import ConfigError
from jaxmem.config.validate import check_distributed as rules
from jaxmem.cli import _quiet_native_stderr
from jaxmem.runtime.aot import resolve_topology
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.report import offload_requested
from jaxmem.config.targets import target_for_device_kind
from jaxmem.cli.help import HelpFormatter
from jaxmem.loader import load_config
from jaxmem.io.console import make_console

GIB = 1024**3
NO_CONFIG = "no config given"


def check(name: str, status: str, detail: str) -> dict:
    return {"name": name, "status": status, "detail": detail}


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 or not n else f"{n / 1024**2:.1f} MiB"


def check_platform(devices) -> dict:
    d = devices[0]
    cpu = "; cpu only: GPU checks skipped" if d.platform == "cpu" else ""
    return check("platform", "ok", f"{len(devices)} x {d.device_kind} ({d.platform}){cpu}")


def check_jax() -> dict:
    import jax
    import jaxlib
    found = f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
    for name, version in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__)):
        if not in_range(version, JAX_RANGE):
            return check("jax", "fail", f"{found}: {name} outside the supported >={JAX_RANGE[0]},<{JAX_RANGE[1]}")
    if version_tuple(jax.__version__) != version_tuple(jaxlib.__version__):
        return check("jax", "warn", f"{found}: jax and jaxlib differ; install matching versions")
    return check("jax", "ok", f"{found} (supported >={JAX_RANGE[0]},<{JAX_RANGE[1]})")


def check_cuda_plugin(on_gpu: bool) -> dict:
    found = ", ".join(f"{p} {v}" for p in ("jax-cuda12-plugin", "jax-cuda13-plugin") if (v := installed_version(p)))
    try:
        require_matching_cuda_plugin()
    except UnsupportedVersion as e:
        return check("cuda plugin", "fail", str(e))
    if found:
        return check("cuda plugin", "ok", f"{found} matches jaxlib")
    if on_gpu:
        return check("cuda plugin", "fail", "no jax CUDA plugin installed; pip install 'jaxmem[gpu]'")
    return check("cuda plugin", "skip", "not installed (deviceless GPU plans need it: pip install 'jaxmem[aot]')")


def check_host_kernel(on_gpu: bool) -> dict:
    """The one-pass host AdamW kernel (kernels.host_update): built, or cached, for this machine's CPU; on a GPU
    also registered with the CUDA plugin for its programs' host computations."""
    name = "host AdamW"
    try:
        path = library_path()
        if on_gpu:
            register("gpu")
    except BuildError as e:
        where = "a GPU program's host update runs XLA's code" if on_gpu else \
            "a one-device CPU program's host update runs XLA's code (slower)"
        return check(name, "warn", f"{e}: {where}")
    if on_gpu:
        return check(name, "ok", f"fused kernel built and registered for the GPU's host programs ({path}); "
                                 "kernels.host_update=fused takes it in GPU programs, auto keeps XLA's code")
    return check(name, "ok", f"fused kernel built for this CPU ({path})")


def check_cudnn(on_gpu: bool) -> dict:
    present, version = cudnn_present(), ""
    if on_gpu:  # the backend is up, so the plugin is registered: asking for the version cannot stick "not found"
        try:
            from jax._src.lib import cuda_versions
            v = cuda_versions.cudnn_get_version() if cuda_versions else 0
            version = f" {v // 10000}.{v // 100 % 100}.{v % 100}" if v else ""
        except Exception:  # noqa: BLE001 - the version is a nicety; presence is the check
            pass
        if present or version:
            return check("cudnn", "ok", f"cuDNN{version} found")
        return check("cudnn", "warn", "cuDNN not found: attention=auto runs the Pallas kernel (slower)")
    if present:
        return check("cudnn", "ok", "library present (deviceless cuDNN attention compiles work here)")
    return check("cudnn", "skip", "cpu only, not installed (deviceless cuDNN compiles: 'jaxmem[aot-cudnn]')")


def check_allocator(env: Mapping[str, str], hbm_bytes: int | None, device_total: int | None,
                    where: str = "", headroom: float = 0.0) -> dict:
    """What XLA's allocator will let `jaxmem train` use under this environment: the settings
    jaxmem.plan.allocator.derive gives (its rule, the one train and bench apply), against the plan."""
    shown = ", ".join(f"{k}={env[k]}" for k in ALLOCATOR_VARS if k in env) or "none set"
    if hbm_bytes is None or device_total is None:
        return check("allocator", "skip" if device_total is None else "ok", f"{shown}; {where}")
    settings = derive(device_total, hbm_bytes, headroom, "estimated (analytic)", environ=env)
    if settings.limit_bytes is None:
        return check("allocator", "ok", f"{shown}: no allocator cap")
    need = (f"plan needs {_gib(device_total)} per device, estimated (analytic), = {device_total / hbm_bytes:.0%} "
            f"of {_gib(hbm_bytes)} HBM{where}; allocator cap {settings.limit_bytes / hbm_bytes:.3g} x HBM = "
            f"{_gib(settings.limit_bytes)}")
    ours = [f"export {k}={settings.env[k]}" for k in settings.set_by_jaxmem]
    if ours:
        need += f" (jaxmem train sets it; your own scripts need: {'; '.join(ours)})"
    if device_total > hbm_bytes:
        return check("allocator", "warn", f"{shown}; {need}: more than the HBM itself (`jaxmem plan` it)")
    if settings.warning:
        return check("allocator", "warn", f"{shown}; {settings.warning}")
    return check("allocator", "ok", f"{shown}; {need}")


def check_pinned_host(devices, offload: bool | None) -> dict:
    kinds = sorted({m.kind for m in devices[0].addressable_memories()})
    text = f"memory kinds: {', '.join(kinds)}"
    if devices[0].platform == "cpu":
        return check("pinned host", "skip", f"cpu only ({text}); pinned host memory is checked on GPUs")
    if "pinned_host" in kinds:
        return check("pinned host", "ok", text)
    if offload:
        return check("pinned host", "fail", f"{text}: the config offloads to host but there is no pinned_host "
                                            "memory (upgrade jax / the CUDA plugin, or turn offload off)")
    return check("pinned host", "warn", f"{text}: no pinned_host, so offload configs will not run here")


def mem_total(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_ram(host_bytes_per_node: int | None, ram: int | None, per_device: int = 0,
                   gpus_per_host: int = 0) -> dict:
    if host_bytes_per_node is None or ram is None:
        return check("host RAM", "skip", NO_CONFIG if host_bytes_per_node is None else "no MemTotal in /proc/meminfo")
    if not host_bytes_per_node:
        return check("host RAM", "ok", f"plan keeps nothing in host memory; MemTotal {_gib(ram)}")
    need = (f"plan needs {_gib(host_bytes_per_node)} of host memory per node, estimated (analytic) "
            f"({_gib(per_device)} per device x {gpus_per_host} devices); MemTotal {_gib(ram)}")
    if host_bytes_per_node > ram:
        return check("host RAM", "fail", f"{need}: does not fit (offload less, or run on more hosts)")
    return check("host RAM", "warn", f"{need}: over 90%, little left for the data loader and the OS") \
        if host_bytes_per_node > 0.9 * ram else check("host RAM", "ok", need)


def check_distributed(d, n_devices: int, hosts: int, env: Mapping[str, str]) -> dict:
    try:
        rules(d)
    except ConfigError as e:
        return check("distributed", "fail", str(e))
    if d.coordinator:
        text = f"coordinator {d.coordinator}, process {d.process_id} of {d.num_processes}"
        if n_devices % d.num_processes:
            return check("distributed", "fail", f"{text}: {n_devices} devices do not split over "
                                                f"{d.num_processes} processes")
        if d.num_processes < hosts:
            return check("distributed", "fail", f"{text}: target.hosts={hosts} needs at least {hosts} processes")
        return check("distributed", "ok", f"{text}, {n_devices // d.num_processes} devices each")
    tasks = slurm_tasks(env) if d.auto else 0
    if tasks > 1:
        return check("distributed", "ok", f"SLURM: {tasks} tasks (jax reads the SLURM variables)")
    if hosts > 1:
        return check("distributed", "fail", f"target.hosts={hosts} but no process group: set "
                                            "distributed.coordinator/num_processes/process_id, or run under SLURM")
    return check("distributed", "ok", "single process")


def run_checks(cfg=None, env: Mapping[str, str] | None = None, ram: int | None = None) -> list[dict]:
    import jax
    env = os.environ if env is None else env
    with contextlib.nullcontext() if os.path.exists("/proc/driver/nvidia") else _quiet_native_stderr():
        devices = jax.devices()
    on_gpu = devices[0].platform == "gpu"
    out = [check_platform(devices), check_jax(), check_cuda_plugin(on_gpu), check_cudnn(on_gpu),
           check_host_kernel(on_gpu)]
    if cfg is None:
        return out + [check_allocator(env, None, None, NO_CONFIG), check_pinned_host(devices, None),
                      check_host_ram(None, None), check("distributed", "skip", NO_CONFIG)]
    topo = resolve_topology(cfg)
    bill = compute_bill(cfg, topo.n_devices, gpu=True)
    gpu = topo.gpu or (target_for_device_kind(devices[0].device_kind) if on_gpu else None)
    if gpu is not None:
        alloc = check_allocator(env, gpu.hbm_bytes, bill.device_total, f" ({gpu.name})", cfg.target.headroom)
    else:
        alloc = check_allocator(env, None, None, "no target.name and no known GPU here")
    ram = mem_total() if ram is None else ram
    host = check_host_ram(bill.host_total * topo.gpus_per_host, ram, bill.host_total, topo.gpus_per_host)
    return out + [alloc, check_pinned_host(devices, offload_requested(cfg)), host,
                  check_distributed(cfg.distributed, topo.n_devices, topo.hosts, env)]


STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def render(checks: list[dict], console=None) -> None:
    from rich.text import Text
    console = console or make_console()
    width = max(len(c["name"]) for c in checks)
    for c in checks:
        line = Text(f"{c['status']:<4}", style=STYLE[c["status"]])
        line.append(f"  {c['name']:<{width}}  {c['detail']}")
        console.print(line, highlight=False, soft_wrap=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="jaxmem doctor", formatter_class=HelpFormatter,
        description="Checks this machine for a run: platform and devices, jax / jaxlib / CUDA plugin / cuDNN "
                    "versions, the fused host AdamW kernel's build, the XLA allocator environment, pinned host "
                    "memory (offload), host RAM against the plan's host bytes, and the distributed settings. "
                    "One line per check: ok, warn, fail, or skip (cannot be checked here). Exits 1 when a check "
                    "fails. Without a config, the config-dependent checks are skipped. What to do on warn/fail: "
                    "docs/doctor.md.",
        epilog="examples:\n"
               "  jaxmem doctor                                   # the machine alone\n"
               "  jaxmem doctor configs/qwen2-72b-8xh100.yaml --json doctor.json\n"
               "  jaxmem doctor configs/llama3-8b-8xh100.yaml train.micro_batch=4")
    ap.add_argument("items", nargs="*", help="a config YAML file, then dotted key=value overrides")
    ap.add_argument("--json", dest="json_path", default=None, help="write the checks as a JSON list")
    return ap.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configs = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    if len(configs) > 1:
        raise ConfigError(f"doctor: give one config file (got {len(configs)})")
    if overrides and not configs:
        raise ConfigError("doctor: overrides need a config file")
    cfg = None
    if configs:
        if not Path(configs[0]).is_file():
            raise ConfigError(f"{configs[0]}: config file not found")
        cfg = load_config(configs[0], overrides)
    checks = run_checks(cfg)
    render(checks)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(checks, indent=2))
    return 1 if any(c["status"] == "fail" for c in checks) else 0
