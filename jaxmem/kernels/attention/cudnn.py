"""cuDNN flash attention through JAX's cuDNN fused-attention primitive; NVIDIA GPUs only (no CPU path).

Without segment ids this is the public `jax.nn.dot_product_attention(..., implementation="cudnn")`.

Packed sequences (segment ids) cannot be said through the public API of jax 0.10.2 or 0.11.2: it takes
only a dense mask (a [B, T, S] bias, the memory flash attention removes) or one length per batch row. The
cuDNN primitive under it, `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, takes the
packed ("ragged") layout: per row the start offset and the length of each segment, up to a static
`max_segments`. That API is private, so this module uses it only for the jax versions whose source it
was checked against (`PACKED_RANGE`) and says so in one line otherwise. Two facts about those versions:
- jax <= 0.11.0 scales the kv offsets by the *query* head count (fixed in jax PR #39521, present in
  0.11.2's wheel): for GQA/MQA with packed segments, k and v are repeated to the query heads below that
  version (costs [B, S, N, H] copies of k and v) so the offsets come out right.
- jax checks "Packed layout requires a GPU with at least Hopper architecture" against the process's
  *default* backend, so the packed path lowers only in a process whose default backend is a Hopper+ GPU,
  never in a deviceless compile from a CPU process (the unpacked path does compile deviceless).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.runtime import compat

# jax versions whose private cuDNN attention API (signature, offsets semantics, mask types) was read:
# 0.10.2 (installed here), 0.11.0 and 0.11.2 (source); identical signature in all three.
PACKED_RANGE = ("0.10.2", "0.12")
# First version checked to scale kv offsets by the kv head count (0.11.2's wheel; 0.11.0 still has the bug).
GQA_OFFSETS_FIXED = "0.11.2"
DEFAULT_MAX_SEGMENTS = 16
_FEATURE = "packed sequences in cuDNN attention (jax._src.cudnn.fused_attention_stablehlo)"


def cudnn_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, max_segments: int = DEFAULT_MAX_SEGMENTS,
                    window: int | None = None, scale: float | None = None, sinks=None):
    """Causal GQA attention like `attention_reference` (q [B,T,N,H], k/v [B,S,K,H]) -> [B,T,N,H].

    `window` (a static int): sliding-window attention through cuDNN's sliding_window_length, which skips
    the tiles outside the band as the causal mask skips those above the diagonal.

    With segment ids, each maximal run of equal ids in a row is one document: tokens attend causally
    within their run only. At most `max_segments` runs per row (static: cuDNN keeps softmax statistics for
    B x max_segments sequences); rows with more runs come out NaN rather than silently wrong.

    `sinks` (gpt-oss attention sinks) has no cuDNN form here: anything but None raises ValueError before any
    work is done.
    """
    if sinks is not None:
        raise ValueError("cudnn_attention has no attention sinks (jax.nn.dot_product_attention takes none): use "
                         "kernels.attention='pallas' or 'xla'")
    if window is not None and window >= q_btnh.shape[1]:
        window = None  # as long as the sequence: no window
    if segment_ids_bt is None:
        return jax.nn.dot_product_attention(q_btnh, k_bskh, v_bskh, is_causal=True, implementation="cudnn",
                                            scale=scale, local_window_size=local_window_size(window))
    return _packed_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, max_segments, window, scale)


def local_window_size(window: int | None) -> tuple[int, int] | None:
    """jax.nn.dot_product_attention's (left, right) window for keys less than `window` positions back."""
    return None if window is None else (window - 1, 0)


def packed_segments(segment_ids_bt, max_segments: int):
    """Segment ids [B, T] -> (seqlen [B, M], offsets [B, M + 1], overflow [B]) in the layout jax's cuDNN
    primitive takes: per row the length and start of each run of equal ids, -1 past the last run, with
    M = max_segments. `overflow` marks rows with more than M runs (their extra runs are dropped)."""
    if max_segments < 2:
        raise ValueError(f"max_segments {max_segments} must be >= 2 (cuDNN's packed layout needs M > 1)")
    seg = jnp.asarray(segment_ids_bt)
    b, t = seg.shape
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_bt = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # which run each token is in
    n_runs = run_bt[:, -1] + 1
    rows = jnp.arange(b)[:, None]
    slot = jnp.where(run_bt < max_segments, run_bt, max_segments)  # overflowing runs land in a dropped slot
    seqlen = jnp.zeros((b, max_segments + 1), jnp.int32).at[rows, slot].add(1)[:, :max_segments]
    start_slot = jnp.where(starts, slot, max_segments + 1)  # only run starts write; others are dropped
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    offsets = jnp.full((b, max_segments + 1), -1, jnp.int32).at[rows, start_slot].set(positions, mode="drop")
    used = jnp.arange(max_segments)[None, :] < n_runs[:, None]
    seqlen = jnp.where(used, seqlen, -1)
    offsets = offsets.at[:, max_segments].set(-1)
    return seqlen, offsets, n_runs > max_segments


def _packed_attention(q_btnh, k_bskh, v_bskh, segment_ids_bt, max_segments, window=None, scale=None):
    version = jax.__version__
    if not compat.in_range(version, PACKED_RANGE):
        raise compat.UnsupportedVersion(f"{_FEATURE} supports jax >={PACKED_RANGE[0]},<{PACKED_RANGE[1]}; found "
                                        f"jax {version}: use kernels.attention='pallas' for segment ids")
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

    if q_btnh.shape[1] != k_bskh.shape[1]:
        raise ValueError("cudnn_attention with segment ids needs self-attention (query length == key length)")
    n, kv = q_btnh.shape[2], k_bskh.shape[2]
    if kv != n and compat.version_tuple(version) < compat.version_tuple(GQA_OFFSETS_FIXED):
        k_bskh, v_bskh = (jnp.repeat(x, n // kv, axis=2) for x in (k_bskh, v_bskh))
    seqlen, offsets, overflow = packed_segments(segment_ids_bt, max_segments)
    out = cudnn_fa.dot_product_attention(
        q_btnh, k_bskh, v_bskh, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=q_btnh.shape[-1] ** -0.5 if scale is None else scale, mask_type=cudnn_fa.MaskType.PADDING_CAUSAL,
        qkv_layout="BTNH", sliding_window_length=window)
    return jnp.where(overflow[:, None, None, None], jnp.nan, out).astype(out.dtype)


def backward_workspace_bytes(batch: int, seq: int, heads: int, head_dim: int) -> int:
    """cuDNN's backward workspace (fp32 dQ accumulation, twice): about 2 x B x T x N x H x 4 bytes. XLA sizes
    it only when it compiles with a device, so a deviceless compile leaves it out (the formula against a
    compile on a GPU: benchmarks/constants.md, attention)."""
    return 2 * batch * seq * heads * head_dim * 4


def max_head_dim() -> int:
    """The widest head jax's cuDNN flash attention takes in this process: 256 where the process's own GPU is
    Hopper or later, else 128. jax asks the local GPU, so a deviceless compile from a CPU host is held to 128."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return 128
    capability = getattr(device, "compute_capability", None) if device.platform == "gpu" else None
    if not capability:
        return 128
    return 256 if tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0) else 128


def takes_head_dim(head_dim: int) -> bool:
    """Whether jax's cuDNN flash attention takes `head_dim`: a multiple of 8, at most max_head_dim()."""
    return head_dim % 8 == 0 and head_dim <= max_head_dim()

