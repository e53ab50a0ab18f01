"""Multi-process start-up: `jax.distributed.initialize`, explicit or auto-detected on SLURM.

Must run before anything asks JAX for devices: the backend is created on first use
and cannot join a cluster afterwards.
"""
from __future__ import annotations

import os
from typing import Mapping

import jax

from jaxmem.schema import DistributedConfig
from jaxmem.validate import check_distributed


def _on_cpu() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS") or (jax.config.jax_platforms or "")
    return platforms.split(",")[0] == "cpu" or not os.path.exists("/proc/driver/nvidia")


def slurm_tasks(env: Mapping[str, str]) -> int:
    """Number of tasks of the SLURM job step this process belongs to (0 outside SLURM)."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return 0
    return int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or 1)


def init_settings(cfg: DistributedConfig, env: Mapping[str, str]) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a single-process run.

    The settings' rules are jaxmem.validate.check_distributed (run at load, and here for a config built in code).
    """
    check_distributed(cfg)
    if cfg.coordinator:
        return {"coordinator_address": cfg.coordinator, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if cfg.auto and slurm_tasks(env) > 1:
        return {}  # jax reads the SLURM variables itself
    return None


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> bool:
    """Joins the process group if the config or SLURM asks for one; returns whether it did."""
    kwargs = init_settings(cfg, os.environ if env is None else env)
    if kwargs is None or jax.distributed.is_initialized():
        return False
    if _on_cpu():  # cross-process collectives on CPU need gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
