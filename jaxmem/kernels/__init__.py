"""Fused kernels and the dispatch that turns `kernels.*` config choices into functions.

An implementation that cannot run where it was asked raises KernelUnavailable;
only `auto` falls back. Pallas kernels run in interpret mode on CPU (that is
how their numerics are tested); cuDNN has no CPU path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmem.config.schema import ConfigError, KernelConfig
from jaxmem.kernels.attention.reference import attention_reference
from jaxmem.kernels.cross_entropy.config import CrossEntropyBlocks
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX, linear_cross_entropy_reference
from jaxmem.kernels.grouped_matmul.reference import grouped_matmul_reference
from jaxmem.kernels.rms_norm.lean import rms_norm_lean
from jaxmem.kernels.attention.sequence_parallel import sequence_parallel
from jaxmem.kernels.attention.config import AttentionBlocks
from jaxmem.kernels.attention.pallas import flash_attention
from jaxmem.kernels.attention.cudnn import cudnn_attention
from jaxmem.kernels.rms_norm.pallas import rms_norm
from jaxmem.kernels.grouped_matmul.config import GroupedMatmulBlocks
from jaxmem.kernels.cross_entropy.sharded import shard_loss, shard_token_logprobs
from jaxmem.kernels.cross_entropy.reference import linear_token_logprobs_reference
from jaxmem.kernels.attention import reference as attention_reference_module
from jaxmem.kernels.cross_entropy import chunked as cross_entropy_chunked, pallas as cross_entropy_pallas
from jaxmem.kernels.cross_entropy import reference as cross_entropy_reference
from jaxmem.kernels.grouped_matmul import blocked as grouped_matmul_blocked, pallas as grouped_matmul_pallas

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class KernelUnavailable(RuntimeError):
    pass


def _is_gpu(platform: str) -> bool:
    return platform.lower() in GPU_PLATFORMS


def _pallas_interpret(key: str, platform: str) -> bool:
    """Pallas (Triton backend) runs compiled on GPUs and interpreted on CPU; nowhere else."""
    if _is_gpu(platform):
        return False
    if platform == "cpu":
        return True
    raise KernelUnavailable(f"{key}='pallas' needs a GPU (Triton backend) or CPU (interpret mode), "
                            f"not platform {platform!r}")


@functools.cache
def cudnn_present() -> bool:
    """Whether the cuDNN library can be loaded: always with a CUDA jax install; on a CPU machine only with
    `jaxmem[aot-cudnn]`. Without it a deviceless compile cannot lower cuDNN attention ("cuDNN not found"),
    so `auto` compiles the Pallas flash kernel there (same memory class: neither keeps the S x S scores)."""
    import ctypes.util
    import importlib.util

    try:
        if importlib.util.find_spec("nvidia.cudnn") is not None:
            return True
    except ModuleNotFoundError:
        pass
    return ctypes.util.find_library("cudnn") is not None


def cudnn_takes(dtype, *, segments: bool, sinks: bool) -> bool:
    """Whether cuDNN attention takes a call: fp16 / bf16 (cuDNN refuses fp32), no segment ids (its packed path
    needs a private jax API and a workspace max_segments times larger, docs/attention.md), no attention sinks
    (none in cuDNN). The layout asks it of the program's config, select_attention of each call."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and not segments and not sinks


def resolve(cfg: KernelConfig, platform: str, n_devices: int, cudnn_fits: bool = True) -> dict[str, str]:
    """The implementation each op runs on `platform` in a program over `n_devices` devices (its mesh; a
    pipeline stage's own): the one place `auto` is decided.

    attention: cuDNN on NVIDIA GPUs, faster than the Pallas flash kernel (docs/attention.md), where the
    program's attention calls fit it (`cudnn_fits`: cudnn_takes of its compute dtype, packed documents and
    sinks, jaxmem.core.layout); else the Pallas kernel. XLA on CPU, where Pallas would only interpret. A call
    that does not fit cuDNN (segment ids, sinks, fp32) runs the Pallas kernel whatever the program chose
    (select_attention). loss: chunked, the fastest at the same scratch (benchmarks/kernels.md). norm: XLA,
    which already fuses it (the Pallas kernel saved no bytes). grouped_matmul: never ragged_dot, which XLA:GPU
    densifies (benchmarks/grouped_matmul.md). On one GPU the Pallas kernel, leaner and faster wherever it was
    measured (benchmarks/gpu_h200.md, benchmarks/constants.md: kernels). Over several devices blocked,
    because GSPMD runs the Pallas custom call whole on every device; and on CPU blocked, faster than ragged_dot
    (benchmarks/grouped_matmul.md), where Pallas would only interpret.
    """
    gpu = _is_gpu(platform)
    cudnn = cudnn_fits and cudnn_present()
    auto = {"attention": ("cudnn" if cudnn else "pallas") if gpu else "xla", "loss": "chunked", "norm": "xla",
            "grouped_matmul": "pallas" if gpu and n_devices == 1 else "blocked"}
    return {op: auto[op] if getattr(cfg, op) == "auto" else getattr(cfg, op) for op in auto}


def _devices(mesh) -> int:
    return 1 if mesh is None else mesh.size


def _scoped(scope: str, fn):
    """fn under a named scope ("attention_pallas", "loss_chunked", ...): metadata only, so the traced and
    compiled step say which implementation runs (tests and `explain` read it)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with jax.named_scope(scope):
            return fn(*args, **kwargs)

    return run


def select_attention(cfg: KernelConfig, platform: str, mesh=None):
    """fn(q_btnh, k_bskh, v_bskh, segment_ids_bt, *, window=None, scale=None, sinks=None) -> [B, T, N, H].

    `sinks` [N]: attention sinks (gpt-oss), one logit per query head. With a mesh, Pallas attention runs per
    shard (batch over the data axes, heads over tp, the sinks with the heads); with an sp axis,
    sequence-parallel (jaxmem.kernels.attention.sequence_parallel). An explicit cuDNN choice raises
    ValueError on a call with sinks; auto sends that call to the Pallas kernel.
    """
    impl = resolve(cfg, platform, _devices(mesh))["attention"]
    chosen = _scoped(f"attention_{impl}", _attention(impl, cfg, platform, mesh))
    if cfg.attention != "auto" or impl != "cudnn":
        return sequence_parallel(chosen, mesh)
    # auto: a call cuDNN does not take (cudnn_takes: packed documents, sinks, fp32) goes to the Pallas kernel
    packed = _scoped("attention_pallas", _attention("pallas", cfg, platform, mesh))

    def route(q, k, v, seg, **kw):
        fits = cudnn_takes(q.dtype, segments=seg is not None, sinks=kw.get("sinks") is not None)
        return chosen(q, k, v, None, **kw) if fits else packed(q, k, v, seg, **kw)

    return sequence_parallel(route, mesh)


def _attention(impl: str, cfg: KernelConfig, platform: str, mesh):
    if impl == "xla":
        return lambda q, k, v, seg, **kw: attention_reference(q, k, v, segment_ids_bt=seg, **kw)
    if impl == "pallas":
        check_block_sizes(cfg)
        blocks = AttentionBlocks(block_q=cfg.attn_block_q, block_k=cfg.attn_block_k)
        interpret = _pallas_interpret("kernels.attention", platform)
        return lambda q, k, v, seg, **kw: flash_attention(q, k, v, seg, blocks=blocks, interpret=interpret, mesh=mesh,
                                                          **kw)
    if impl == "cudnn":
        if not _is_gpu(platform):
            raise KernelUnavailable(f"kernels.attention='cudnn' needs an NVIDIA GPU with cuDNN, not platform "
                                    f"{platform!r}; use 'xla' or 'pallas'")
        return cudnn_attention
    raise KernelUnavailable(f"kernels.attention={impl!r} is not a known implementation")


def select_norm(cfg: KernelConfig, platform: str, mesh=None):
    """fn(x, weight, eps) -> y. With a mesh, Pallas RMSNorm runs per shard (rows over the data axes)."""
    impl = resolve(cfg, platform, _devices(mesh))["norm"]
    return _scoped(f"norm_{impl}", _norm(impl, platform, mesh))


def _norm(impl: str, platform: str, mesh):
    if impl == "xla":  # the reference's value; its backward keeps x in x's dtype, not an fp32 copy
        return rms_norm_lean
    if impl == "pallas":
        interpret = _pallas_interpret("kernels.norm", platform)
        return lambda x, w, eps=1e-6: rms_norm(x, w, eps, interpret=interpret, mesh=mesh)
    raise KernelUnavailable(f"kernels.norm={impl!r} is not a known implementation")


def select_grouped_matmul(cfg: KernelConfig, platform: str, mesh=None):
    """fn(lhs [M, D], rhs [G, D, F], group_sizes [G], *, preferred_element_type=None) -> [M, F], rows sorted by
    group, as jax.lax.ragged_dot. The MoE layer's experts call it; GSPMD partitions it like any XLA op."""
    impl = resolve(cfg, platform, _devices(mesh))["grouped_matmul"]
    return _scoped(f"grouped_matmul_{impl}", _grouped_matmul(impl, cfg, platform))


def _grouped_matmul(impl: str, cfg: KernelConfig, platform: str):
    if impl == "ragged_dot":
        return grouped_matmul_reference
    check_block_sizes(cfg)
    blocks = GroupedMatmulBlocks(block_rows=cfg.grouped_matmul_block_rows)
    if impl == "blocked":
        return functools.partial(grouped_matmul_blocked.grouped_matmul, blocks=blocks)
    if impl == "pallas":
        interpret = _pallas_interpret("kernels.grouped_matmul", platform)
        return functools.partial(grouped_matmul_pallas.grouped_matmul, blocks=blocks, interpret=interpret)
    raise KernelUnavailable(f"kernels.grouped_matmul={impl!r} is not a known implementation")


_POWER_OF_TWO_KEYS = ("attn_block_q", "attn_block_k", "fused_loss_block_t", "fused_loss_block_v",
                      "fused_loss_block_d", "grouped_matmul_block_rows")


def check_model_kernels(cfg) -> None:
    """The attention kernel the config names takes the model (a run config: kernels vs model)."""
    if cfg.model.attention_sinks and cfg.kernels.attention == "cudnn":
        raise ConfigError("kernels.attention: cudnn has no attention sinks (model.attention_sinks, gpt-oss); use "
                          "auto (the Pallas kernel on a GPU), pallas or xla")


def check_block_sizes(cfg: KernelConfig) -> None:
    """One-line ConfigError naming the key. Runs at load (jaxmem.features.SECTION_VALIDATORS["kernels"]);
    the dispatch below runs it again for a KernelConfig built in code, before anything is traced."""
    for name in ("loss_block_t", "loss_block_v"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"kernels.{name}: {getattr(cfg, name)} must be a positive int, or 0 (by shape)")
    for name in _POWER_OF_TWO_KEYS:
        value = getattr(cfg, name)
        if value <= 0:
            raise ConfigError(f"kernels.{name}: {value} must be a positive int")
        if name in _POWER_OF_TWO_KEYS and (value & (value - 1) or value < 16):
            raise ConfigError(f"kernels.{name}: {value} must be a power of two >= 16 (Triton tiles)")


def loss_blocks(cfg: KernelConfig) -> CrossEntropyBlocks:
    check_block_sizes(cfg)
    return CrossEntropyBlocks(block_t=cfg.loss_block_t, block_v=cfg.loss_block_v,
                              pallas_block_t=cfg.fused_loss_block_t, pallas_block_v=cfg.fused_loss_block_v,
                              pallas_block_d=cfg.fused_loss_block_d)


def select_loss(cfg: KernelConfig, platform: str, mesh=None, dw_axes: tuple | None = None):
    """fn(h, w_dv, labels) -> (loss_sum, n_valid), h [T, D] with labels [T] or [B, T, D] with [B, T].

    With a mesh, the fused kernels run per shard (rows over the data axes, the
    sequence over sp, vocab over tp) inside shard_map instead of being
    replicated by GSPMD; `dw_axes`: the mesh axes the head's gradient is kept
    split over along D, where dW is reduce-scattered (sharded.shard_loss), None
    where the head is not trained.
    """
    impl = resolve(cfg, platform, _devices(mesh))["loss"]
    return _scoped(f"loss_{impl}", _loss(impl, cfg, platform, mesh, dw_axes))


def _flattening(loss):
    """loss(h_td, w, labels_t) taking [B, T, D] / [B, T] too (GSPMD flattens them where the loss is global)."""

    @functools.wraps(loss)
    def run(h, w, labels):
        return loss(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1))

    return run


def _loss(impl: str, cfg: KernelConfig, platform: str, mesh, dw_axes: tuple | None = None):
    blocks = loss_blocks(cfg)
    if impl == "naive":
        return _flattening(functools.partial(linear_cross_entropy_reference, ignore_index=IGNORE_INDEX,
                                             z_loss=cfg.z_loss))
    if impl == "chunked":
        module = cross_entropy_chunked
        extra = {}
    elif impl == "pallas":
        module = cross_entropy_pallas
        extra = {"interpret": _pallas_interpret("kernels.loss", platform)}
    else:
        raise KernelUnavailable(f"kernels.loss={impl!r} is not a known implementation")
    if mesh is None or mesh.size == 1:
        return _flattening(functools.partial(module.linear_cross_entropy, blocks=blocks, ignore_index=IGNORE_INDEX,
                                             z_loss=cfg.z_loss, **extra))
    forward = functools.partial(module.forward_stats, blocks=blocks, ignore_index=IGNORE_INDEX, **extra)
    backward = functools.partial(module.backward_grads, blocks=blocks, ignore_index=IGNORE_INDEX, z_loss=cfg.z_loss,
                                 **extra)
    return shard_loss(forward, backward, mesh, ignore_index=IGNORE_INDEX, z_loss=cfg.z_loss, dw_axes=dw_axes)


def select_token_logprobs(cfg: KernelConfig, platform: str, mesh=None, dw_axes: tuple | None = None):
    """fn(h, w_dv, labels) -> per-token log-probs of the labels (fp32, labels' shape, 0 on IGNORE_INDEX), h
    [T, D] with labels [T] or [B, T, D] with [B, T]: the loss `select_loss` picks, per token (a preference
    objective sums them per sequence), through the same fused kernels, so no [tokens, vocab] array exists."""
    impl = resolve(cfg, platform, _devices(mesh))["loss"]
    return _scoped(f"logprobs_{impl}", _token_logprobs(impl, cfg, platform, mesh, dw_axes))


def _token_logprobs(impl: str, cfg: KernelConfig, platform: str, mesh, dw_axes: tuple | None):
    blocks = loss_blocks(cfg)
    if impl == "naive":
        fn = functools.partial(linear_token_logprobs_reference, ignore_index=IGNORE_INDEX)
    elif impl in ("chunked", "pallas"):
        module = cross_entropy_chunked if impl == "chunked" else cross_entropy_pallas
        extra = {"interpret": _pallas_interpret("kernels.loss", platform)} if impl == "pallas" else {}
        if mesh is not None and mesh.size > 1:
            forward = functools.partial(module.forward_stats, blocks=blocks, ignore_index=IGNORE_INDEX, **extra)
            backward = functools.partial(module.backward_grads, blocks=blocks, ignore_index=IGNORE_INDEX, **extra)
            return shard_token_logprobs(forward, backward, mesh, ignore_index=IGNORE_INDEX, dw_axes=dw_axes)
        fn = functools.partial(module.linear_token_logprobs, blocks=blocks, ignore_index=IGNORE_INDEX, **extra)
    else:
        raise KernelUnavailable(f"kernels.loss={impl!r} is not a known implementation")

    def run(h, w, labels):
        return fn(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1)).reshape(labels.shape)

    return run


def platform_of(devices) -> str:
    devices = list(devices) if devices is not None else []
    return devices[0].platform if devices else jax.default_backend()


def loss_scratch_bytes(impl: str, tokens: int, vocab: int, cfg: KernelConfig, d_model: int,
                       itemsize: int) -> int:
    """Per-device loss-phase scratch of the resolved loss `impl`, from the kernel's own formula."""
    formula = {"naive": cross_entropy_reference.scratch_bytes, "chunked": cross_entropy_chunked.scratch_bytes,
               "pallas": cross_entropy_pallas.scratch_bytes}[impl]
    return formula(tokens, vocab, loss_blocks(cfg), d_model=d_model, itemsize=itemsize)


def attention_bytes(impl: str, score_elems: int, compute_itemsize: int) -> tuple[int, int]:
    """(saved across the backward if kept, backward working set) of one layer's attention, per device.
    Fused kernels (pallas, cudnn) never materialize the S x S scores."""
    if impl != "xla":
        return 0, 0
    return (attention_reference_module.saved_bytes(score_elems, compute_itemsize),
            attention_reference_module.scratch_bytes(score_elems, compute_itemsize))
