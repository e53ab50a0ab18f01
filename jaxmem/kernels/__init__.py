"""Fused kernels and the dispatch that turns `kernels.*` config choices into functions.

An implementation that cannot run where it was asked raises KernelUnavailable;
only `auto` falls back.
"""
from __future__ import annotations

import functools

import jax

from jaxmem.config import KernelConfig
from jaxmem.kernels.attention.reference import attention_reference
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX, linear_cross_entropy_reference
from jaxmem.kernels.rms_norm.reference import rms_norm_reference


class KernelUnavailable(RuntimeError):
    pass


def select_attention(cfg: KernelConfig, platform: str):
    """fn(q_btnh, k_bskh, v_bskh, segment_ids_bt) -> [B, T, N, H]."""
    impl = cfg.attention
    if impl == "auto":
        impl = "xla"
    if impl == "xla":
        return lambda q, k, v, seg: attention_reference(q, k, v, segment_ids_bt=seg)
    raise KernelUnavailable(f"kernels.attention={impl!r} is not implemented yet")


def select_norm(cfg: KernelConfig, platform: str):
    """fn(x, weight, eps) -> y."""
    impl = cfg.norm
    if impl in ("auto", "xla"):
        return rms_norm_reference
    raise KernelUnavailable(f"kernels.norm={impl!r} is not implemented yet")


def select_loss(cfg: KernelConfig, platform: str):
    """fn(h_td, w_dv, labels_t) -> (loss_sum, n_valid)."""
    impl = cfg.loss
    if impl == "auto":
        impl = "naive"
    if impl == "naive":
        return functools.partial(linear_cross_entropy_reference, ignore_index=IGNORE_INDEX, z_loss=cfg.z_loss)
    raise KernelUnavailable(f"kernels.loss={impl!r} is not implemented yet")


def platform_of(devices) -> str:
    return devices[0].platform if devices else jax.default_backend()
