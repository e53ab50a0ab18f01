"""Compile-only GPU devices for deviceless compiles on a CPU machine (needs the `aot` extra), and the
resolution of which target/topology a plan compiles for (config `target` section, overridden by flags)."""
from __future__ import annotations

import dataclasses
import functools
import math

from jaxmem import compat
from jaxmem.config import Config, ConfigError
from jaxmem.targets import GpuTarget, get_target


@functools.cache
def target_devices(target: str, gpus_per_host: int, hosts: int = 1) -> tuple:
    """Compile-only devices of `hosts` x `gpus_per_host` GPUs of the named target."""
    import jax
    from jax._src import xla_bridge
    from jax.experimental.topologies import get_topology_desc

    compat.require("deviceless GPU topologies (jaxmem.aot)")
    compat.require_matching_cuda_plugin()
    xla_bridge._discover_and_register_pjrt_plugins()  # the CUDA plugin registers its topology factory here
    try:
        topo = get_topology_desc(target, "cuda", target_config=get_target(target).target_config_text(),
                                 topology=f"1x{hosts}x{gpus_per_host}")
    except NotImplementedError as e:
        raise compat.UnsupportedVersion(
            f"deviceless GPU compiles need jax-cuda12-plugin and jax-cuda12-pjrt (or the cuda13 pair) at jax's "
            f"version {jax.__version__}: pip install 'jaxmem[aot]'") from e
    return tuple(topo.devices)


@dataclasses.dataclass(frozen=True)
class Topology:
    """What a plan compiles for: a named GPU target (deviceless) or, with name "", the attached devices."""

    name: str
    gpus_per_host: int
    hosts: int
    headroom: float
    host_ram_bytes: int

    @property
    def n_devices(self) -> int:
        return self.gpus_per_host * self.hosts

    @property
    def gpu(self) -> GpuTarget | None:
        return get_target(self.name) if self.name else None

    @property
    def label(self) -> str:
        return f"{self.n_devices} x {self.name}" if self.name else f"{self.n_devices} x attached"

    def devices(self) -> tuple:
        if self.name:
            return target_devices(self.name, self.gpus_per_host, self.hosts)
        import jax

        return tuple(jax.devices()[: self.n_devices])


def _mesh_size(cfg: Config) -> int | None:
    sizes = (cfg.parallel.dp, cfg.parallel.fsdp, cfg.parallel.tp)
    return None if -1 in sizes else math.prod(sizes)


def resolve_topology(cfg: Config, target: str | None = None, gpus_per_host: int | None = None,
                     hosts: int | None = None) -> Topology:
    """Flags win over the config's `target` section; the device count defaults to the mesh size."""
    t = cfg.target
    name = t.name if target is None else target
    hosts = t.hosts if hosts is None else hosts
    per_host = gpus_per_host or t.gpus_per_host
    if hosts < 1:
        raise ConfigError(f"target.hosts: must be >= 1, got {hosts}")
    if not per_host:
        mesh = _mesh_size(cfg)
        if mesh is None and name:
            raise ConfigError("target.gpus_per_host: required when the parallel mesh has a -1 (fill) axis; "
                              "set target.gpus_per_host or pass --gpus-per-host")
        if mesh is None:
            import jax

            mesh = len(jax.devices())
        if mesh % hosts:
            raise ConfigError(f"target.hosts: {hosts} does not divide the mesh size {mesh}")
        per_host = mesh // hosts
    if per_host < 1:
        raise ConfigError(f"target.gpus_per_host: must be >= 1, got {per_host}")
    gpu = get_target(name) if name else None  # validates the name before any compile
    ram = int(t.host_ram_gb * 1024**3) if t.host_ram_gb else (gpu.host_ram_bytes if gpu else 0)
    topo = Topology(name, per_host, hosts, t.headroom, ram)
    mesh = _mesh_size(cfg)
    if mesh is not None and mesh != topo.n_devices:
        raise ConfigError(f"parallel: dp*fsdp*tp={mesh} != {topo.n_devices} devices of {topo.label}")
    return topo
