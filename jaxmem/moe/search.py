"""Expert parallelism in the search space of `jaxmem tune` and `jaxmem sweep`: the `parallel.ep` values a
mixture of experts can take on a device count, kept only where loading the config accepts them."""
from __future__ import annotations

from typing import Callable

from jaxmem.config.schema import ConfigError


def ep_candidates(n_experts: int, n_devices: int) -> list[int]:
    """ep values that divide both the experts and the devices, 1 first; [1] for a dense model (0 experts)."""
    if n_experts <= 0:
        return [1]
    return [ep for ep in range(1, n_devices + 1) if n_devices % ep == 0 and n_experts % ep == 0]


def ep_overrides(ep: int, n_devices: int) -> list[str]:
    """The all-fsdp mesh with ep of its devices as the expert axis (ep is a token axis for everything else)."""
    return ["parallel.dp=1", "parallel.sp=1", "parallel.tp=1", "parallel.rules=fsdp",
            f"parallel.fsdp={n_devices // ep}", f"parallel.ep={ep}", "parallel.zero_stage=3"]


def accepted_ep_values(load: Callable[[list[str]], object], n_experts: int, n_devices: int,
                       overrides: Callable[[int, int], list[str]] = ep_overrides) -> list[int]:
    """The ep candidates whose config `load(overrides(ep, n_devices))` accepts (a ConfigError, NotYetSupported
    included, drops one). 1 always stays: it is the mesh without expert parallelism."""
    out = []
    for ep in ep_candidates(n_experts, n_devices):
        if ep == 1:
            out.append(ep)
            continue
        try:
            load(overrides(ep, n_devices))
        except ConfigError:
            continue
        out.append(ep)
    return out


def ep_mesh_options(load: Callable[[list[str]], object], n_experts: int, n_devices: int) -> list[list[str]]:
    """tune's extra meshes for a mixture of experts: one per accepted ep > 1 (none for a dense model)."""
    return [ep_overrides(ep, n_devices) for ep in accepted_ep_values(load, n_experts, n_devices) if ep > 1]


def expand_auto_ep(grid: dict[str, list[str]], load: Callable[[list[str]], object], n_experts: int,
                   n_devices: int) -> dict[str, list[str]]:
    """A sweep grid with `parallel.ep=auto` replaced by the accepted ep values (only ep itself overridden:
    the sweep's mesh fills around it)."""
    if grid.get("parallel.ep") != ["auto"]:
        return grid
    values = accepted_ep_values(load, n_experts, n_devices, lambda ep, _: [f"parallel.ep={ep}"])
    return {**grid, "parallel.ep": [str(v) for v in values]}
