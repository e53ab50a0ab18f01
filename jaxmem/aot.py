"""Compile-only GPU devices for deviceless compiles on a CPU machine (needs the `aot` extra)."""
from __future__ import annotations

import functools

from jaxmem.targets import get_target


@functools.cache
def target_devices(target: str, gpus_per_host: int, hosts: int = 1) -> tuple:
    """Compile-only devices of `hosts` x `gpus_per_host` GPUs of the named target."""
    from jax._src import xla_bridge
    from jax.experimental.topologies import get_topology_desc

    xla_bridge._discover_and_register_pjrt_plugins()  # the CUDA plugin registers its topology factory here
    try:
        topo = get_topology_desc(target, "cuda", target_config=get_target(target).target_config_text(),
                                 topology=f"1x{hosts}x{gpus_per_host}")
    except NotImplementedError as e:
        raise RuntimeError("deviceless GPU compiles need jax-cuda12-plugin and jax-cuda12-pjrt==0.10.2 "
                           "(pip install 'jaxmem[aot]')") from e
    return tuple(topo.devices)
