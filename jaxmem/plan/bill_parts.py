"""The base model's pieces of the analytic bill (jaxmem.plan.bill): the checkpointed tensors' shapes, one
layer's backward working set, the attention's phase, the loss's scratch, the default update's peak, the batch."""
from __future__ import annotations

import math

import jax

from jaxmem import kernels
from jaxmem.config.names import CheckpointName as CN
from jaxmem.config.schema import Config
from jaxmem.core import embed_grad
from jaxmem.core.accounting import is_state_value, itemsize, plain_grad_bytes, rest_leaf_elems
from jaxmem.core.layout import Layout
from jaxmem.core.precision import Precision
from jaxmem.model.layers import ACT_BTD, ACT_BTF, ACT_BTNH
from jaxmem.model.seq_tiling import INSIDE_TILES, tile_count
from jaxmem.config.targets import TARGETS
from jaxmem.io.data import batch_keys

_BTD = (CN.LAYER_INPUT, CN.ATTN_NORM, CN.ATTN_OUT, CN.MLP_NORM, CN.MLP_OUT)
_BTF = (CN.MLP_GATE, CN.MLP_UP, CN.MLP_ACT)


def name_shapes(cfg: Config, layout: Layout) -> dict[str, int]:
    """Elements per device of each checkpointed tensor of a dense layer, sharded by the activation rules (a
    feature's bill term changes them: the mixture of experts' routed rows; the bill's own are Bill.per_name)."""
    m, rows, seq = cfg.model, layout.rows, cfg.train.seq_len
    btd = layout.per_device_elems(ACT_BTD, (rows, seq, m.d_model))
    btf = layout.per_device_elems(ACT_BTF, (rows, seq, m.d_ff))
    q = layout.per_device_elems(ACT_BTNH, (rows, seq, m.n_heads, m.head_dim))
    kv = layout.per_device_elems(ACT_BTNH, (rows, seq, m.n_kv_heads, m.head_dim))
    out = {n.value: btd for n in _BTD}
    out.update({n.value: btf for n in _BTF})
    out.update({CN.QUERY_PROJ.value: q, CN.ATTN_CONTEXT.value: q, CN.KEY_PROJ.value: kv, CN.VALUE_PROJ.value: kv})
    out[CN.FLASH_RESIDUALS.value] = q + 2 * q // m.head_dim  # the output, and an fp32 logsumexp per row and head
    return out


def working_elems(cfg: Config, layout: Layout, per_name: dict[str, int]) -> int:
    """Elements per device live in one layer's backward at its peak, the MLP's backward: the layer's forward
    intermediates (recomputed or read back) once, plus the gradients of the two [tokens, d_ff] MLP inputs
    (gate and up), as `jaxmem explain` shows (benchmarks/constants.md, bill_parts); the other gradients of the
    layer come later, when the MLP's are dead. With sequence tiling the parts inside
    the tiles hold one tile at a time; with sequence parallelism q, k, v and the context also exist head-split
    while the all-to-alls run."""
    n_tiles = tile_count(cfg.train.seq_len, layout.mesh_sizes["sp"], cfg.remat.seq_tile)
    tiled = {n: v // n_tiles if n in INSIDE_TILES else v for n, v in per_name.items()}
    total = sum(tiled.values()) + tiled[CN.MLP_GATE.value] + tiled[CN.MLP_UP.value]
    if layout.mesh_sizes["sp"] > 1:
        total += sum(per_name[n.value] for n in (CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ, CN.ATTN_CONTEXT))
    return total


def attention_phase_bytes(cfg: Config, layout: Layout, per_name: dict[str, int], cd: int) -> int:
    """Bytes per device live beyond the resident state in one layer's flash-attention backward: the layer
    input (the q/k/v part reruns from it) and the residual stream's gradient, q, k, v, the context's
    gradient, dq, dk, dv and two fp32 [T, heads] row statistics; with local and global layers in one body
    (model.global_every: a lax.cond) one more q-sized buffer; in sequence tiles the layer input's gradient
    in a buffer of its own where no q/k/v gradient has its size (_tiled_vjp writes it over one that has).
    Read off `jaxmem explain` timelines at the Pallas backward kernels (the cases: benchmarks/constants.md,
    bill_parts). Without tiles the MLP backward's working set is the larger."""
    m = cfg.model
    q, kv, btd = (per_name[n.value] for n in (CN.QUERY_PROJ, CN.KEY_PROJ, CN.LAYER_INPUT))
    elems = 2 * btd + 3 * q + 4 * kv + (q if m.sliding_window and m.global_every else 0)
    if tile_count(cfg.train.seq_len, layout.mesh_sizes["sp"], cfg.remat.seq_tile) > 1 \
            and m.d_model not in (m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim):
        elems += btd
    return elems * cd + 2 * (q // m.head_dim) * 4


def score_elems(cfg: Config, layout: Layout) -> int:
    """Elements per device of one layer's attention score matrix [B, N, T, S] (plain XLA attention); sequence
    parallelism splits it sp ways (heads, or queries where the heads do not split)."""
    seq = cfg.train.seq_len
    elems = layout.per_device_elems(("act_batch", "act_heads", None, None), (layout.rows, cfg.model.n_heads, seq, seq))
    return elems // layout.mesh_sizes["sp"]


def no_checkpoint_residuals(per_name: dict[str, int], cd: int, model=None) -> dict[str, int]:
    """Per-layer bytes autodiff keeps without any checkpoint: more than the tagged names (the norms' inputs,
    roped q/k), as `jaxmem explain` of llama3-8b (remat none) on 8 x h100-80g showed. The gated activation
    keeps only gate and up (jaxmem.model.gated) and each RMSNorm only its input in the compute dtype
    (jaxmem.kernels.rms_norm.lean): no activation internals, no fp32 copies (the layer scan's stacked
    residuals of configs/tiny.yaml and tiny-gemma3.yaml, remat none, bf16, list exactly these).
    With q/k norms (`model.qk_norm`) their inputs too (the normed q/k are the roped ones); with post-norms
    their two inputs (the post-normed output only feeds the residual add). (LoRA keeps fewer: jaxmem.lora.bill.)"""
    btd, btf = per_name[CN.LAYER_INPUT.value], per_name[CN.MLP_GATE.value]
    q, kv = per_name[CN.QUERY_PROJ.value], per_name[CN.KEY_PROJ.value]
    out = {
        "mlp_gate": btf * cd, "mlp_up": btf * cd, "mlp_act": btf * cd,
        "norm_inputs": 2 * btd * cd, "attn_norm": btd * cd, "mlp_norm": btd * cd,
        "query_proj_roped": q * cd, "attn_context": q * cd,
        "key_proj": kv * cd, "key_proj_roped": kv * cd, "value_proj": kv * cd,
    }
    if model is not None and model.qk_norm:
        out.update(qk_norm_inputs=(q + kv) * cd)
    if model is not None and model.post_norms:
        out.update(post_norm_inputs=2 * btd * cd)
    return out


def logits_bytes(cfg: Config, layout: Layout) -> int:
    """Live loss-side bytes per device beyond the LM head: the resolved loss kernel's own scratch formula."""
    tokens = layout.per_device_elems(ACT_BTD[:2], (layout.rows, cfg.train.seq_len))
    vocab = layout.per_device_elems(("act_vocab",), (cfg.model.vocab_size,))
    cd = itemsize(Precision.from_config(cfg.precision).compute)
    return kernels.loss_scratch_bytes(layout.kernels["loss"], tokens, vocab, cfg.kernels, cfg.model.d_model, cd)


def plain_update_phase_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int]) -> int:
    """Device bytes at the peak of the default update, state on the device (jaxmem.optim.layerwise.layerwise_update):
    the layers are updated in place one at a time (one layer's fp32 temporaries, under the backward's peak),
    then the embedding, final norm and LM head, once the layers' gradients are dead: at the largest leaf's
    update the device holds the resident state, the non-layer gradients, that leaf's gradient widened to
    fp32 (the embedding's rows made a table: jaxmem.core.embed_grad) and its new weight (`jaxmem explain` of a
    4-layer d_model 1024 Llama-3 at seq 8192 on one h100-80g, deviceless: the fp32 embedding gradient, the new
    bf16 embedding and the LM head's bf16 gradient at the peak)."""
    resident = sum(device[k] for k in ("params", "base", "master", "opt_m", "opt_v", "inputs"))
    largest = next(iter(rest_leaf_elems(layout)), 0)
    widened = largest * 4 if embed_grad.applies(cfg, layout, prec) else 0
    return resident + plain_grad_bytes(cfg, layout, prec, rest_only=True) + widened \
        + largest * itemsize(prec.param)


def device_memory_of(cfg: Config, device_memory: int | None) -> int:
    if device_memory is not None:
        return device_memory
    target = TARGETS.get(cfg.target.name or "")
    return target.hbm_bytes if target else 0


def batch_row_elems(cfg: Config) -> int:
    """int32 elements of one batch row: seq_len + 1 tokens, or seq_len per record array (inputs, labels,
    and with packing segment ids and positions)."""
    keys = batch_keys(cfg)
    return cfg.train.seq_len + 1 if keys == ("tokens",) else len(keys) * cfg.train.seq_len


def counter_bytes(state: dict) -> int:
    """Replicated bookkeeping in the train state (step, optimizer counters, loss scale), read off the
    program's own state layout (jaxmem.core.accounting.abstract_train_state) so it follows jaxmem.core.program."""
    small = [x for k, x in state.items() if k not in ("params", "master", "opt")]
    small += [x for x in jax.tree.leaves(state["opt"]) if not is_state_value(x)]
    return sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(small))
