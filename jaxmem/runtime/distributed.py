"""Multi-process start-up: `jax.distributed.initialize`, explicit or auto-detected on SLURM.

Must run before anything asks JAX for devices: the backend is created on first use
and cannot join a cluster afterwards.

Failure settings (docs/lifecycle.md): jax's coordination service declares a process dead after
HEARTBEAT_S seconds without a heartbeat (sooner than jax's default) and a finishing process waits at most
SHUTDOWN_S seconds for the others at the exit barrier (also below jax's default). jaxmem.train.peer_watch
notices a dead peer sooner still (its STALE_S) and ends the survivors with one line; the heartbeat is the
backstop.
"""
from __future__ import annotations

import inspect
import os
from typing import Callable, Mapping

import jax

from jaxmem.config.schema import DistributedConfig
from jaxmem.config.validate import check_distributed
from jaxmem.runtime import cpu_host
from jaxmem.runtime.compat import JAX_RANGE, in_range


HEARTBEAT_S = 45  # the backstop: far enough above peer_watch.STALE_S that a loaded host cannot let it fire first
SHUTDOWN_S = 60


def slurm_tasks(env: Mapping[str, str]) -> int:
    """Number of tasks of the SLURM job step this process belongs to (0 outside SLURM)."""
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return 0
    return int(env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or 1)


def init_settings(cfg: DistributedConfig, env: Mapping[str, str]) -> dict | None:
    """The keyword arguments for jax.distributed.initialize, or None for a single-process run.

    The settings' rules are jaxmem.config.validate.check_distributed (run at load, and here for a config built in code).
    """
    check_distributed(cfg)
    if cfg.coordinator:
        return {"coordinator_address": cfg.coordinator, "num_processes": cfg.num_processes,
                "process_id": cfg.process_id}
    if cfg.auto and slurm_tasks(env) > 1:
        return {}  # jax reads the SLURM variables itself
    return None


def expected_processes(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> int:
    """How many processes the run will have (before any joined): the config's, SLURM's, else 1."""
    kwargs = init_settings(cfg, os.environ if env is None else env)
    if kwargs is None:
        return 1
    return kwargs.get("num_processes") or slurm_tasks(os.environ if env is None else env) or 1


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> bool:
    """Joins the process group if the config or SLURM asks for one; returns whether it did."""
    kwargs = init_settings(cfg, os.environ if env is None else env)
    if kwargs is None or jax.distributed.is_initialized():
        return False
    if cpu_host.on_cpu():  # cross-process collectives on CPU need gloo
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs, **failure_settings())
    return True


def failure_settings() -> dict:
    """heartbeat_timeout_seconds / shutdown_timeout_seconds for jax.distributed.initialize, where it takes them."""
    accepted = inspect.signature(jax.distributed.initialize).parameters
    wanted = {"heartbeat_timeout_seconds": HEARTBEAT_S, "shutdown_timeout_seconds": SHUTDOWN_S}
    return {k: v for k, v in wanted.items() if k in accepted}


def runtime_client():
    """jax's distributed runtime client (a private API, checked for jaxmem.runtime.compat.JAX_RANGE), or None (no process
    group, or a jax outside that range: the watch is then off and jax's own heartbeat ends a lost run)."""
    if not in_range(jax.__version__, JAX_RANGE):
        return None
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except (ImportError, AttributeError):
        return None


def process_group() -> tuple[int, int]:
    """(this process's index, number of processes) without starting the backend (allocator settings may still
    have to be applied); (0, 1) outside a process group."""
    if runtime_client() is None:  # a jax outside the checked range: ask the backend (it starts now)
        return (jax.process_index(), jax.process_count()) if jax.distributed.is_initialized() else (0, 1)
    try:
        from jax._src import distributed

        state = distributed.global_state
        if state.client is not None:
            return int(state.process_id), int(state.num_processes)
    except (ImportError, AttributeError, TypeError):
        pass
    return 0, 1


def decided_on_lead(key: str, decide: Callable[[], None], *errors: type[Exception]) -> None:
    """Runs `decide` on process 0 only; if it raises one of `errors`, every process raises it with the same
    message (and the same type).

    One process: `decide()` as is. Several: process 0 publishes "" or the error's type and message in the
    coordination service's key-value store and the others wait for it (so a refused lock stops every process
    at once).
    """
    client = runtime_client()
    index, count = process_group()
    if client is None or count == 1:
        decide()
        return
    key = f"jaxmem/decided/{key}"
    if index == 0:
        try:
            decide()
        except errors as e:
            which = next(i for i, error in enumerate(errors) if isinstance(e, error))
            client.key_value_set(key, f"{which}:{e}")
            raise
        client.key_value_set(key, "")
        return
    message = client.blocking_key_value_get(key, 600_000)
    if message:
        which, _, text = message.partition(":")
        raise errors[int(which)](text or errors[int(which)].__name__)
