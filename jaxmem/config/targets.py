"""GPU targets as data: the XLA GpuTargetConfigProto text plus the figures the cost model needs."""
from __future__ import annotations

import dataclasses
from jaxmem.config.schema import ConfigError


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

    def peak_flops(self, compute_dtype: str) -> float:
        """Dense matmul peak for the compute dtype. fp32 matmuls run as TF32 on these GPUs by default,
        at half the bf16 rate on every shipped target (per the same datasheets)."""
        return self.bf16_flops / 2 if compute_dtype == "float32" else self.bf16_flops

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
    "h200-141g": GpuTarget(
        name="h200-141g", description="NVIDIA H200", hbm_bytes=150_754_820_096, hbm_bandwidth=4.8e12,
        bf16_flops=989e12, host_link_bandwidth=55e9, interconnect_bandwidth=450e9, host_ram_bytes=2 * 1024**4,
        compute_capability=(9, 0), core_count=132, clock_ghz=1.98, l2_bytes=52_428_800,
        shared_memory_per_core=233_472, shared_memory_per_block_optin=232_448,
        source="NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s "
               "bidirectional, PCIe Gen5 x16; same Hopper SM as H100 SXM; DGX H200 host RAM 2 TB; "
               "device_memory_size = 143771 MiB as the driver reports it"),
    "a100-80g": GpuTarget(
        name="a100-80g", description="NVIDIA A100-SXM4-80GB", hbm_bytes=85_899_345_920, hbm_bandwidth=2.039e12,
        bf16_flops=312e12, host_link_bandwidth=25e9, interconnect_bandwidth=300e9, host_ram_bytes=2 * 1024**4,
        compute_capability=(8, 0), core_count=108, clock_ghz=1.41, l2_bytes=41_943_040,
        shared_memory_per_core=167_936, shared_memory_per_block_optin=166_912,
        source="NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense bf16, 80 GB HBM2e 2,039 GB/s, NVLink 600 GB/s "
               "bidirectional, PCIe Gen4 x16 (~25 GB/s per direction in practice); A100 whitepaper: 108 SMs, "
               "40 MB L2, 164 KB shared memory per SM; DGX A100 640GB host RAM 2 TB"),
    "a100-40g": GpuTarget(
        name="a100-40g", description="NVIDIA A100-SXM4-40GB", hbm_bytes=42_949_672_960, hbm_bandwidth=1.555e12,
        bf16_flops=312e12, host_link_bandwidth=25e9, interconnect_bandwidth=300e9, host_ram_bytes=1024**4,
        compute_capability=(8, 0), core_count=108, clock_ghz=1.41, l2_bytes=41_943_040,
        shared_memory_per_core=167_936, shared_memory_per_block_optin=166_912,
        source="NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOP/s dense bf16, 40 GB HBM2 1,555 GB/s, NVLink 600 GB/s "
               "bidirectional, PCIe Gen4 x16 (~25 GB/s per direction in practice); DGX A100 320GB host RAM 1 TB"),
    "l40s-48g": GpuTarget(
        name="l40s-48g", description="NVIDIA L40S", hbm_bytes=48_305_799_168, hbm_bandwidth=864e9,
        bf16_flops=362.05e12, host_link_bandwidth=25e9, interconnect_bandwidth=25e9, host_ram_bytes=1024**4,
        compute_capability=(8, 9), core_count=142, clock_ghz=2.52, l2_bytes=100_663_296,
        shared_memory_per_core=102_400, shared_memory_per_block_optin=101_376,
        source="NVIDIA L40S datasheet: 362.05 TFLOP/s dense bf16 (733 with sparsity), 48 GB GDDR6 864 GB/s, "
               "PCIe Gen4 x16 64 GB/s bidirectional, no NVLink (GPU<->GPU over PCIe); Ada whitepaper: 142 SMs, "
               "96 MB L2, 100 KB shared memory per SM; host RAM 1 TB is an assumed server figure (override "
               "target.host_ram_gb)"),
    "rtx4090-24g": GpuTarget(
        name="rtx4090-24g", description="NVIDIA GeForce RTX 4090", hbm_bytes=25_757_220_864, hbm_bandwidth=1.008e12,
        bf16_flops=165.2e12, host_link_bandwidth=25e9, interconnect_bandwidth=25e9, host_ram_bytes=128 * 1024**3,
        compute_capability=(8, 9), core_count=128, clock_ghz=2.52, l2_bytes=75_497_472,
        shared_memory_per_core=102_400, shared_memory_per_block_optin=101_376,
        source="NVIDIA Ada Lovelace whitepaper (RTX 4090): 165.2 TFLOP/s bf16 tensor with fp32 accumulate, 24 GB "
               "GDDR6X 1,008 GB/s, 128 SMs, 72 MB L2, PCIe Gen4 x16, no NVLink; host RAM 128 GB is an assumed "
               "workstation figure (override target.host_ram_gb)"),
}


def get_target(name: str) -> GpuTarget:
    if name not in TARGETS:
        raise ConfigError(f"target.name: {name!r} is unknown; use one of {', '.join(TARGETS)}")
    return TARGETS[name]


def target_for_device_kind(kind: str) -> GpuTarget | None:
    """The GPU target whose device description is exactly `kind` (`Device.device_kind`, case and spaces
    ignored), else None: a near miss (another form factor of a target's GPU) has other peaks, so it gets no
    target."""
    key = " ".join(kind.split()).lower()
    return next((t for t in TARGETS.values() if t.description.lower() == key), None)
