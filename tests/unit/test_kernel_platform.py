"""jaxmem.kernels.platform_of: the one name of a device platform that kernel choices and layouts compare."""
from types import SimpleNamespace

from jaxmem import kernels


def test_platform_of_names_every_gpu_platform_gpu():
    """CUDA and ROCm devices (compile-only ones too) are "gpu", others keep their own name."""
    assert kernels.platform_of([SimpleNamespace(platform="cuda")]) == "gpu"
    assert kernels.platform_of([SimpleNamespace(platform="rocm")]) == "gpu"
    assert kernels.platform_of([SimpleNamespace(platform="cpu")]) == "cpu"
    assert kernels.platform_of(None) == "cpu"  # the default backend here
