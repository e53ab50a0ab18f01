"""GPU targets as data: the XLA GpuTargetConfigProto text plus the figures the cost model needs."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    name: str
    description: str  # device_description_str
    hbm_bytes: int  # device_memory_size as XLA sees it
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float  # dense peak, FLOP/s
    host_link_bandwidth: float  # bytes/s per direction, GPU <-> host
    interconnect_bandwidth: float  # bytes/s per direction, intra-node GPU <-> GPU
    host_ram_bytes: int  # per node (overridable by target.host_ram_gb)
    compute_capability: tuple[int, int]
    core_count: int
    clock_ghz: float
    l2_bytes: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    source: str

    def target_config_text(self) -> str:
        major, minor = self.compute_capability
        return (
            "gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 "
            "shared_memory_per_block: 49152 "
            f"shared_memory_per_core: {self.shared_memory_per_core} threads_per_core_limit: 2048 "
            f"core_count: {self.core_count} fpus_per_core: 128 block_dim_limit_x: 2147483647 "
            "block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
            f"memory_bandwidth: {int(self.hbm_bandwidth)} l2_cache_size: {self.l2_bytes} "
            f"clock_rate_ghz: {self.clock_ghz} device_memory_size: {self.hbm_bytes} "
            f"shared_memory_per_block_optin: {self.shared_memory_per_block_optin} "
            f"cuda_compute_capability {{ major: {major} minor: {minor} }} "
            "registers_per_core_limit: 65536 registers_per_block_limit: 65536 } "
            'runtime_version { major: 12 minor: 8 } platform_name: "CUDA" '
            f'dnn_version_info {{ major: 9 minor: 7 }} device_description_str: "{self.description}"'
        )


TARGETS: dict[str, GpuTarget] = {
    "h100-80g": GpuTarget(
        name="h100-80g", description="NVIDIA H100 80GB HBM3", hbm_bytes=84_929_347_584, hbm_bandwidth=3.35e12,
        bf16_flops=989e12, host_link_bandwidth=55e9, interconnect_bandwidth=450e9, host_ram_bytes=2 * 1024**4,
        compute_capability=(9, 0), core_count=132, clock_ghz=1.98, l2_bytes=52_428_800,
        shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448,
        source="NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s "
               "bidirectional, PCIe Gen5 x16 (~55 GB/s per direction in practice); DGX H100 host RAM 2 TB"),
}


def get_target(name: str) -> GpuTarget:
    from jaxmem.config import ConfigError

    if name not in TARGETS:
        raise ConfigError(f"target.name: {name!r} is unknown; use one of {', '.join(TARGETS)}")
    return TARGETS[name]
