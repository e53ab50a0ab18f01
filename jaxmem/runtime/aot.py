"""Compile-only GPU devices for deviceless compiles on a CPU machine (needs the `aot` extra), and the
resolution of which target/topology a plan compiles for (config `target` section, overridden by flags)."""
from __future__ import annotations

import dataclasses
import functools

from jaxmem.runtime import compat
from jaxmem.config import validate
from jaxmem.config.schema import Config
from jaxmem.config.targets import GpuTarget, get_target
from jaxmem.runtime import ptxas_cache


@functools.cache
def target_devices(target: str, gpus_per_host: int, hosts: int = 1) -> tuple:
    """Compile-only devices of `hosts` x `gpus_per_host` GPUs of the named target."""
    import jax
    from jax._src import xla_bridge
    from jax.experimental.topologies import get_topology_desc

    compat.require("deviceless GPU topologies (jaxmem.runtime.aot)")
    compat.require_matching_cuda_plugin()
    ptxas_cache.install()  # where JAXMEM_PTXAS_CACHE names a directory: kernels compiled once, not per compile
    xla_bridge._discover_and_register_pjrt_plugins()  # the CUDA plugin registers its topology factory here
    try:
        topo = get_topology_desc(target, "cuda", target_config=get_target(target).target_config_text(),
                                 topology=f"1x{hosts}x{gpus_per_host}")
    except NotImplementedError as e:
        raise compat.UnsupportedVersion(
            f"deviceless GPU compiles need jax-cuda12-plugin and jax-cuda12-pjrt (or the cuda13 pair) at jax's "
            f"version {jax.__version__}: pip install 'jaxmem[aot]'") from e
    return tuple(topo.devices)


def lowering_target(device):
    """A context for lowering a function onto `device`: for a compile-only GPU device (a deviceless compile
    on a machine whose default backend is another), it makes that device the default, which is where Pallas'
    Triton lowering reads the GPU generation from from jax 0.11 on (it raises "No supported GPU devices
    found" otherwise; jax 0.10.2 assumed compute capability 9.0). A no-op for attached devices."""
    import contextlib

    import jax

    if device.platform == jax.default_backend():
        return contextlib.nullcontext()
    return jax.default_device(device)


def compile_abstract(fn, *args):
    """`fn` jitted and compiled for the device its abstract arguments (ShapeDtypeStructs with a sharding) are
    placed on, a compile-only device included: the lowering runs under lowering_target."""
    import jax

    device = next(iter(jax.tree.leaves(args)[0].sharding.device_set))
    with lowering_target(device):
        return jax.jit(fn).lower(*args).compile()


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


def add_target_args(parser) -> None:
    """The flags of every CLI that compiles for a topology (plan, explain, sweep); resolve_topology reads them."""
    parser.add_argument("--target", default=None,
                        help="GPU target to compile for deviceless, e.g. h100-80g (default: target.name in the "
                             "config, else the attached devices)")
    parser.add_argument("--gpus-per-host", type=int, default=None,
                        help="GPUs per host (default: target.gpus_per_host, else the mesh size / hosts)")
    parser.add_argument("--hosts", type=int, default=None, help="number of hosts (default: target.hosts)")


def _attached_device_count() -> int:
    import jax

    return len(jax.devices())


def resolve_topology(cfg: Config, target: str | None = None, gpus_per_host: int | None = None,
                     hosts: int | None = None) -> Topology:
    """Flags win over the config's `target` section; the device count defaults to the mesh size.
    The config's own values were checked at load; the rules here are jaxmem.config.validate's, for the flags."""
    t = cfg.target
    name = t.name if target is None else target
    hosts = t.hosts if hosts is None else hosts
    per_host = gpus_per_host or t.gpus_per_host
    validate.check_hosts(hosts)
    if not per_host:
        per_host = validate.per_host_from_mesh(cfg, name, hosts, _attached_device_count)
    gpu = get_target(name) if name else None  # validates the name before any compile
    ram = int(t.host_ram_gb * 1024**3) if t.host_ram_gb else (gpu.host_ram_bytes if gpu else 0)
    topo = Topology(name, per_host, hosts, t.headroom, ram)
    validate.check_topology(cfg, per_host, topo.n_devices, topo.label)
    return topo
