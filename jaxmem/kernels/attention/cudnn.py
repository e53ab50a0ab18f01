"""cuDNN flash attention through `jax.nn.dot_product_attention`; real NVIDIA GPUs only (no CPU path)."""
from __future__ import annotations

import jax


def cudnn_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None):
    """Causal GQA attention like `attention_reference` (q [B,T,N,H], k/v [B,S,K,H])."""
    if segment_ids_bt is not None:
        # a dense [B, T, S] mask would bring back the memory flash attention removes
        raise NotImplementedError("kernels.attention='cudnn' does not take segment ids (packed sequences) yet; "
                                  "use kernels.attention='pallas'")
    return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True, implementation="cudnn")
