"""The analytic per-device memory bill: model states, saved activations by checkpoint name, working set,
logits, temporaries and host-resident bytes, computed from the config alone (no compile)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem import kernels
from jaxmem.config.schema import Config
from jaxmem.core.layout import Layout, resolve, spec_leaves
from jaxmem.model.layers import ACT_BTD, ACT_BTF, ACT_BTNH
from jaxmem.model.names import CheckpointName as CN
from jaxmem.core.optim import split_layers
from jaxmem.mesh.sharding import spec_ways
from jaxmem.core import embed_grad
from jaxmem.plan import bill_moe
from jaxmem.core.grad_dtype import planned_dtype
from jaxmem.plan.categories import BILL_TO_EXPLAIN
from jaxmem.core.precision import Precision
from jaxmem.core.seq_tiling import INSIDE_TILES, tile_count

# Device-bill categories in display order (each named with its explain category in plan/categories.py);
# `host` holds the host-resident counterparts.
CATEGORIES = tuple(BILL_TO_EXPLAIN)
HOST_CATEGORIES = ("params", "master", "opt_m", "opt_v", "activations", "temporaries")

_BTD = (CN.LAYER_INPUT, CN.ATTN_NORM, CN.ATTN_OUT, CN.MLP_NORM, CN.MLP_OUT)
_BTF = (CN.MLP_GATE, CN.MLP_UP, CN.MLP_ACT)


@dataclasses.dataclass
class Bill:
    """Per-device bytes; every figure is an estimate (analytic)."""

    device: dict[str, int]
    host: dict[str, int]
    activations_by_name: dict[str, int]  # saved on device, all layers
    offloaded_by_name: dict[str, int]  # saved on host, all layers
    mesh: dict[str, int]
    notes: list[str]
    layout: Layout  # the decisions counted: the same object build_program builds from
    # The plain-XLA S x S score copies inside working_set: live only while the layer's attention backward
    # runs, when the layer's MLP weights (gathered) and their full gradients (in temporaries) are not.
    attention_scratch: int = 0
    # Gradient bytes not yet allocated while the loss phase runs (the decoder layers' gradients, when the
    # optimizer state lives on the host: `jaxmem explain` of llama3-8b full remat + optimizer on host shows
    # the layer gradient buffers created at the layer scan's backward, after the loss's logits are dead).
    absent_in_loss: int = 0
    # Bytes of the stored embedding / LM head weights already dead while the layers' backward runs: donated,
    # last read by the loss, and never read by the update (see _rest_weights_dead_in_layers).
    absent_in_layers: int = 0
    # The device peak of an optimizer update streamed from the host (offload.optimizer=host with
    # optimizer_update=device): a whole device-side total, not added to the rest (0 when the update does not
    # stream). See update_phase_bytes.
    update_phase: int = 0
    # A mixture of experts: the experts' masked per-group copies inside working_set (jaxmem.plan.bill_moe),
    # live only in the experts' weight-gradient backward, without the attention's S x S copies and before the
    # layer's full gradients and next gathered layer (Mixtral and Qwen3-30B-A3B widths, deviceless h100-80g:
    # the state, these copies and little else at the peak).
    moe_scratch: int = 0
    # A flash kernel's attention backward (attention_phase_bytes): its own phase, beside working_set (the
    # MLP backward's); the larger with sequence tiles, where the MLP runs a tile at a time.
    attention_phase: int = 0

    @property
    def layer_phase(self) -> int:
        """One layer's backward at its peak: the attention backward (working set with the S x S copies, or
        a flash kernel's phase), the MLP backward (working set without them, plus the gathered weights and
        full gradients), or a mixture of experts' backward (with its expanded rows, without the temporaries)."""
        d = self.device
        ws, attn, moe = d["working_set"], self.attention_scratch, self.moe_scratch
        phases = [ws - moe, ws - attn - moe + d["temporaries"], self.attention_phase]
        if moe:
            phases.append(ws - attn)
        return max(phases)

    @property
    def device_total(self) -> int:
        """The estimated peak: the loss phase (logits, LM head) and one layer's backward (layer_phase) are
        never live together; the larger counts."""
        d = self.device
        phases = ("working_set", "logits", "temporaries")
        steady = sum(v for k, v in d.items() if k not in phases) + max(
            self.layer_phase - self.absent_in_layers, d["logits"] - self.absent_in_loss)
        return max(steady, self.update_phase)

    @property
    def host_total(self) -> int:
        """Host state plus the larger of the offloaded activations and the host optimizer update's buffers:
        the activations are dead before the update runs, so XLA reuses their host space."""
        h = self.host
        return sum(v for k, v in h.items() if k not in ("activations", "temporaries")) + max(h["activations"],
                                                                                          h["temporaries"])

    def to_json(self) -> dict:
        return {**{k: int(v) for k, v in self.device.items()}, "device_total": int(self.device_total),
                "host": {k: int(v) for k, v in self.host.items()}, "host_total": int(self.host_total),
                "activations_by_name": dict(self.activations_by_name),
                "offloaded_by_name": dict(self.offloaded_by_name), "notes": list(self.notes),
                "attention_scratch": int(self.attention_scratch),
                "absent_in_loss": int(self.absent_in_loss), "absent_in_layers": int(self.absent_in_layers),
                "update_phase": int(self.update_phase),
                "moe_scratch": int(self.moe_scratch), "attention_phase": int(self.attention_phase),
                "label": "estimated (analytic)"}


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _shard_elems(shape, spec, sizes) -> int:
    return math.prod(shape) // spec_ways(spec, sizes)


def _per_device(tree, specs, sizes: dict[str, int], *, in_bytes: bool = False) -> int:
    """Per-device elements (or bytes, each leaf at its own dtype) of `tree` sharded by `specs`."""
    return sum(_shard_elems(x.shape, s, sizes) * (x.dtype.itemsize if in_bytes else 1)
               for x, s in zip(jax.tree.leaves(tree), spec_leaves(specs), strict=True))


def _model_elems(layout: Layout, part: str) -> int:
    """Per-device elements of the model's `part` as the step uses it (all-gathered over the data axes)."""
    return _per_device(layout.model_abstract_params[part], layout.model_gathered_specs[part], layout.mesh_sizes)


def _largest_frozen_linear(cfg: Config, layout: Layout) -> int:
    """Per-device elements of a LoRA run's largest frozen linear of one layer as a matmul reads it: whole
    (FSDP gathers it), split over tensor parallelism."""
    from jaxmem.lora.adapters import target_weights

    return max(w.in_features * w.out_features for name, w in target_weights(cfg.model).items()
               if name in layout.lora.frozen) // layout.mesh_sizes["tp"]


def _base_bytes(layout: Layout) -> int:
    """Per-device bytes of a LoRA run's frozen base in its stored form (0 for a full fine-tune)."""
    if layout.base_abstract is None:
        return 0
    return _per_device(layout.base_abstract, layout.base_specs, layout.mesh_sizes, in_bytes=True)


def _state_elems(layout: Layout, specs, part: str | None = None) -> int:
    """Per-device elements of the params tree (or its `part` subtree), sharded by `specs`."""
    params = layout.abstract_params if part is None else layout.abstract_params[part]
    return _per_device(params, specs if part is None else specs[part], layout.mesh_sizes)


def _state_bytes(layout: Layout, specs, dtype, part: str | None = None) -> int:
    return _state_elems(layout, specs, part) * _itemsize(dtype)


def _in_backward_grads(cfg: Config, layout: Layout, dtype) -> int:
    """Gradient bytes live at once with optimizer.update_in_backward: one layer's, and the largest of the
    embedding / final norm / LM head gradients (each is updated as soon as it exists: the compiled step
    updates the LM head during the backward, before the embedding's gradient appears)."""
    (rest, _), (rest_specs, _) = split_layers(layout.abstract_params), split_layers(layout.grad_specs)
    largest = max(_shard_elems(x.shape, s, layout.mesh_sizes)
                  for x, s in zip(jax.tree.leaves(rest), spec_leaves(rest_specs), strict=True))
    return (_state_elems(layout, layout.grad_specs, "layers") // cfg.model.n_layers + largest) * _itemsize(dtype)


def _plain_grad_bytes(cfg: Config, layout: Layout, prec: Precision, *, rest_only: bool = False) -> int:
    """Gradient bytes per device of the default step: the projection weights' at the params' dtype where
    their gradient is a widened one (jaxmem.core.grad_dtype), every other leaf's at grad_reduce_dtype
    (`rest_only`: the embedding, final norm and LM head only)."""
    flat = jax.tree_util.tree_flatten_with_path(layout.abstract_params)[0]
    total = 0
    for (path, x), spec in zip(flat, spec_leaves(layout.grad_specs), strict=True):
        name = str(getattr(path[-1], "key", path[-1]))
        if rest_only and str(getattr(path[0], "key", path[0])) == "layers":
            continue
        if len(path) == 1 and name == "embed" and embed_grad.applies(cfg, layout, prec):
            # its touched rows (jaxmem.core.embed_grad): fp32 sums per distinct token, the rows' gradient
            total += embed_grad.rows_bytes(cfg, layout, prec)
            continue
        dtype = planned_dtype(name, cfg, prec, sp=layout.mesh_sizes["sp"])
        total += _shard_elems(x.shape, spec, layout.mesh_sizes) * _itemsize(dtype)
    return total


def name_shapes(cfg: Config, layout: Layout) -> dict[str, int]:
    """Elements per device of each checkpointed tensor, for one layer, sharded by the activation rules."""
    m, rows, seq = cfg.model, layout.rows, cfg.train.seq_len
    btd = layout.per_device_elems(ACT_BTD, (rows, seq, m.d_model))
    btf = layout.per_device_elems(ACT_BTF, (rows, seq, m.d_ff))
    q = layout.per_device_elems(ACT_BTNH, (rows, seq, m.n_heads, m.head_dim))
    kv = layout.per_device_elems(ACT_BTNH, (rows, seq, m.n_kv_heads, m.head_dim))
    out = {n.value: btd for n in _BTD}
    out.update({n.value: btf for n in _BTF})
    out.update({CN.QUERY_PROJ.value: q, CN.ATTN_CONTEXT.value: q, CN.KEY_PROJ.value: kv, CN.VALUE_PROJ.value: kv})
    out[CN.FLASH_RESIDUALS.value] = q + 2 * q // m.head_dim  # the output, and an fp32 logsumexp per row and head
    if bill_moe.is_moe(cfg):  # the experts' routed rows instead of the dense MLP's [tokens, d_ff] values
        out.update(bill_moe.name_shapes(cfg, layout, _itemsize(Precision.from_config(cfg.precision).compute)))
    return out


def _working_elems(cfg: Config, layout: Layout, per_name: dict[str, int]) -> int:
    """Elements per device live in one layer's backward at its peak, the MLP's backward: the layer's forward
    intermediates (recomputed or read back) once, plus the gradients of the two [tokens, d_ff] MLP inputs
    (gate and up). `jaxmem explain` of the H100 cases (jax 0.11.2): at seq 131072 four [T, d_ff] and about
    eight [T, d_model] buffers, at seq 32768 with selective remat the same on top of the saved stack; the
    other gradients of the layer come later, when the MLP's are dead. With sequence tiling the parts inside
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
    Read off `jaxmem explain` timelines at the Pallas backward kernels (1 x H100, deviceless, jax 0.10.2):
    Llama-3-8B at 512K (full fine-tune) and 1M (QLoRA; full with the update in the backward) hold 5 [T, 4096]
    and 4 [T, 1024] bf16 buffers; with 48 heads and sinks 3 [T, 6144], 3 [T, 4096] and 4 [T, 1024]; with
    128-token local layers every other layer one [T, 4096] more; gpt-oss-20b QLoRA at 1M 4 [T, 4096],
    3 [T, 2880] and 4 [T, 512]; with sequence parallelism (Llama-3-8B at 4M on 8 x H100, sp 8) the same per
    device, head-split, no copies added. Without tiles the MLP backward's working set is the larger."""
    m = cfg.model
    q, kv, btd = (per_name[n.value] for n in (CN.QUERY_PROJ, CN.KEY_PROJ, CN.LAYER_INPUT))
    elems = 2 * btd + 3 * q + 4 * kv + (q if m.sliding_window and m.global_every else 0)
    if bill_moe.seq_tiles(cfg, layout) > 1 and m.d_model not in (m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim):
        elems += btd
    return elems * cd + 2 * (q // m.head_dim) * 4


def score_elems(cfg: Config, layout: Layout) -> int:
    """Elements per device of one layer's attention score matrix [B, N, T, S] (plain XLA attention); sequence
    parallelism splits it sp ways (heads, or queries where the heads do not split)."""
    seq = cfg.train.seq_len
    elems = layout.per_device_elems(("act_batch", "act_heads", None, None), (layout.rows, cfg.model.n_heads, seq, seq))
    return elems // layout.mesh_sizes["sp"]


def no_checkpoint_residuals(per_name: dict[str, int], cd: int, model=None, lora=None) -> dict[str, int]:
    """Per-layer bytes autodiff keeps without any checkpoint: more than the tagged names (the norms' inputs,
    roped q/k), as `jaxmem explain` of llama3-8b (remat none) on 8 x h100-80g showed. The gated activation
    keeps only gate and up (jaxmem.model.gated) and each RMSNorm only its input in the compute dtype
    (jaxmem.kernels.rms_norm.lean): no activation internals, no fp32 copies (the layer scan's stacked
    residuals of configs/tiny.yaml and tiny-gemma3.yaml, remat none, bf16, list exactly these).
    With q/k norms (`model.qk_norm`) their inputs too (the normed q/k are the roped ones); with post-norms
    their two inputs (the post-normed output only feeds the residual add).
    LoRA (`lora`: its LoraSetup): a projection input that only a frozen weight's dW would read is not kept."""
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
    if lora is not None:
        # No dW: `jaxmem explain` of QLoRA Llama-3-8B widths (seq 512, micro-batch 2, remat none, 4 layers,
        # all-linear and q,v) shows no k before RoPE, and a projection's input only where its adapters' dA
        # reads it (the attention context stays: the flash backward reads it).
        del out["key_proj"]
        for name, readers in (("mlp_act", ("w_down",)), ("attn_norm", ("wq", "wk", "wv")),
                              ("mlp_norm", ("w_gate", "w_up"))):
            if not set(readers) & set(lora.targets):
                del out[name]
    return out


def _head_grad_itemsize(layout: Layout, prec: Precision) -> int:
    """Bytes per element of the LM head's whole gradient in the loss's backward. A fused loss (chunked, Pallas)
    writes dW in the dtype the head is used in, the compute dtype: with weights stored in that dtype it stays
    so (`jaxmem explain` of Qwen2.5-7B, 8 x H100 FSDP, full remat: one bf16 [3584, 152064] dW at the loss's
    peak, reduce-scattered before the layers' backward). The plain-XLA loss's dot with the fp32 logits
    gradient makes it fp32, as does the cast back to wider stored weights."""
    cd, param = _itemsize(prec.compute), _itemsize(prec.param)
    return cd if layout.kernels["loss"] != "naive" and param == cd else 4


def _rest_weights_dead_in_layers(cfg: Config, layout: Layout, prec: Precision) -> bool:
    """Whether the stored embedding / final norm / LM head weights are dead through the layers' backward: the
    step donates them and the loss reads them last, where the update writes fresh ones from the fp32 master
    without reading the old (no fp16 loss scaling, whose skipped step keeps them; no state on the host, which
    also rules out the pieces written over them; not the in-backward update). `jaxmem explain` of the 8-layer
    Llama-3-8B full fine-tune on one H100: the bf16 embedding's buffer ends at instruction 17 of 733, the LM
    head's at 199, the layers' backward peaks at 282. A LoRA base is not donated: it stays."""
    return (layout.lora is None and prec.master and not cfg.precision.loss_scale.enabled
            and not layout.host_state and not cfg.optimizer.update_in_backward)


def logits_bytes(cfg: Config, layout: Layout) -> int:
    """Live loss-side bytes per device beyond the LM head: the resolved loss kernel's own scratch formula."""
    tokens = layout.per_device_elems(ACT_BTD[:2], (layout.rows, cfg.train.seq_len))
    vocab = layout.per_device_elems(("act_vocab",), (cfg.model.vocab_size,))
    itemsize = _itemsize(Precision.from_config(cfg.precision).compute)
    return kernels.loss_scratch_bytes(layout.kernels["loss"], tokens, vocab, cfg.kernels, cfg.model.d_model, itemsize)


def compute_bill(cfg: Config, n_devices: int, gpu: bool = True, layout: Layout | None = None,
                 device_memory: int | None = None) -> Bill:
    """Analytic per-device bill for `cfg` sharded over `n_devices` GPUs (or, with gpu=False, CPU devices:
    `auto` kernels resolve differently). Every decision comes from `layout` (default: resolved here).
    `device_memory` (bytes of one GPU; default: cfg.target.name's) only sets how much of a streamed
    optimizer update XLA's scheduler prefetches (update_phase_bytes)."""
    layout = layout or resolve(cfg, n_devices, "gpu" if gpu else "cpu")
    sizes = layout.mesh_sizes
    prec = Precision.from_config(cfg.precision)
    m = cfg.model
    params = _state_bytes(layout, layout.param_specs, prec.param)
    grads = _plain_grad_bytes(cfg, layout, prec)  # cast to fp32 on use
    if cfg.optimizer.update_in_backward:
        grads = _in_backward_grads(cfg, layout, prec.grad_reduce)
    master = _state_bytes(layout, layout.opt_specs, np.float32) if prec.master else 0
    moment = _state_bytes(layout, layout.opt_specs, prec.moment)
    accum, rows = layout.grad_accum, layout.rows
    inputs = accum * (rows // layout.data_ways) * _batch_row_elems(cfg) * 4 + _counter_bytes(cfg, layout)
    cd = _itemsize(prec.compute)

    per_name = name_shapes(cfg, layout)
    if layout.checkpointed:
        saved_dev = {n: per_name[n] * cd * m.n_layers for n, w in layout.saved.items() if w == "device"}
    else:
        saved_dev = {k: v * m.n_layers for k, v in no_checkpoint_residuals(per_name, cd, m, layout.lora).items()}
    saved_host = {n: per_name[n] * cd * m.n_layers for n, w in layout.saved.items() if w == "host"}
    notes = []
    if bill_moe.is_moe(cfg):  # jaxmem.model.moe: the routed rows (jaxmem.plan.bill_moe)
        notes.append(bill_moe.note(cfg, layout))
        if not layout.checkpointed:
            saved_dev = {k: v for k, v in saved_dev.items() if k not in bill_moe.DENSE_MLP}
            if bill_moe.seq_tiles(cfg, layout) == 1:  # in sequence tiles they are recomputed, tile by tile
                saved_dev.update({k: v * m.n_layers for k, v in bill_moe.residual_bytes(cfg, layout, cd).items()})
    scores_saved, scores_working = kernels.attention_bytes(layout.kernels["attention"], score_elems(cfg, layout), cd)
    if layout.keeps_scores:
        saved_dev["attention_scores"] = scores_saved * m.n_layers
        notes.append("plain XLA attention keeps the S x S scores of every layer (use a flash kernel or a "
                     "policy that does not save dots)")
    activations = sum(saved_dev.values())

    # One layer's backward: its forward intermediates come back (recomputed or saved) plus their gradients,
    # and plain-XLA attention's S x S copies. At the attention backward's peak `jaxmem explain` (llama3.2-1b
    # and llama3-8b, full remat, seq 4096, 8 x h100-80g) shows fp32 probs, fp32 probs gradient and the bf16
    # scores gradient (10 bytes per element); the bool mask (the 11th byte of the kernel's scratch formula)
    # lives only in the forward, where no gradient is live yet.
    if scores_working:
        scores_working -= score_elems(cfg, layout) * 1  # the pred mask, forward only
    working = _working_elems(cfg, layout, bill_moe.working_names(cfg, per_name)) * cd + scores_working
    moe_scratch = bill_moe.kernel_scratch_bytes(cfg, layout, cd) if bill_moe.is_moe(cfg) else 0
    if moe_scratch:
        working += bill_moe.working_bytes(cfg, layout, cd)
    logits = logits_bytes(cfg, layout)
    if layout.kernels["loss"] == "naive" and "opt" not in layout.host_state:
        # The naive loss's fp32 logits gradient (the take_along_axis scatter-add, [tokens, vocab] per
        # device): with the optimizer update on the device XLA schedules the LM head's weight-gradient dot
        # after the layer scan, so this buffer stays live through every layer's backward (`jaxmem explain`
        # of llama3.2-1b and llama3-8b, full remat: input_scatter_fusion.1, 1.96 GiB, live across the
        # backward while loop). With the optimizer on the host that dot runs before the scan.
        tokens = layout.per_device_elems(ACT_BTD[:2], (layout.rows, cfg.train.seq_len))
        vocab = layout.per_device_elems(("act_vocab",), (m.vocab_size,))
        working += tokens * vocab * 4

    # A layer's full weight gradients (one device: written whole, then stored), and under FSDP its weights
    # all-gathered in the compute dtype; the loss phase gathers the LM head alike.
    gathered = cfg.parallel.zero_stage == 3 and layout.data_ways * layout.mesh_sizes["sp"] > 1
    layer_full = _model_elems(layout, "layers") // m.n_layers - bill_moe.ungathered_expert_elems(cfg, layout)
    head_full = _model_elems(layout, "embed" if m.tie_embeddings else "lm_head")
    layer_grad = _itemsize(planned_dtype("w_gate", cfg, prec))  # a projection's gradient (jaxmem.core.grad_dtype)
    if gathered and not bill_moe.is_moe(cfg):
        # A dense layer under FSDP: each weight's gradient is reduce-scattered as its dot makes it and the
        # weights are gathered one by one, so at the MLP backward's peak at most the layer's gathered weights
        # are held, no whole gradient (`jaxmem explain`, 8 x H100 FSDP, full remat, seq 8192: Llama-3-8B holds
        # its gathered w_gate and attention weights, 0.18 GiB; Qwen2.5-7B w_gate, w_up and attention, 0.31 GiB;
        # one gathered layer is 0.41 / 0.43 GiB).
        temporaries = layer_full * cd
    else:
        # A mixture of experts gathers each layer whole and its gradient arrives whole before the reduce-scatter,
        # both double-buffered (jaxmem.plan.bill_moe; Mixtral and Qwen3-30B-A3B widths, `jaxmem explain`).
        temporaries = 2 * layer_full * layer_grad + (2 * layer_full * cd if gathered else 0)
    if layout.lora is not None:
        # No weight gradient and no merged weight: a frozen linear is dequantized in the compute dtype where a
        # matmul reads it, forward or backward (jaxmem.lora.linear), one at the peak (`jaxmem explain`, QLoRA
        # Llama-3-8B widths, seq 512, remat none, 4 layers: one [d_model x d_ff] bf16 and its stored slice).
        temporaries = _largest_frozen_linear(cfg, layout) * (cd + 1) \
            + (2 * _base_bytes(layout) // m.n_layers if gathered else 0)
        notes.append(f"LoRA rank {layout.lora.rank} on {', '.join(layout.lora.targets)}: base stored as "
                     f"{layout.lora.base_dtype}, gradients and optimizer state for the adapters only")
    if cfg.optimizer.update_in_backward:  # the layer's gradient is in `grads`; its fp32 update temps here
        temporaries -= layer_full * _itemsize(prec.grad_reduce)
        if "opt" in layout.host_state:  # one layer's state streamed through the device, leaf by leaf
            temporaries += in_backward_stream_bytes(cfg, layout, prec, _device_memory(cfg, device_memory))
    if layout.lora is None:  # the LM head's gradient (a LoRA head is frozen: no dW, whatever its dtype)
        logits += head_full * _head_grad_itemsize(layout, prec)
    if gathered and (layout.lora is None or not layout.lora.quantize_embeddings):  # a stored head is never whole
        logits += head_full * cd
    if accum > 1:
        temporaries += _state_bytes(layout, layout.grad_specs, np.float32)  # fp32 accumulator
    device = dict(params=params, base=_base_bytes(layout), params_for_grad=0, grads=grads, master=master,
                  opt_m=moment, opt_v=moment, inputs=inputs, activations=activations, working_set=working,
                  logits=logits, temporaries=temporaries)
    host = {k: 0 for k in HOST_CATEGORIES}
    if "opt" in layout.host_state:
        for k in ("master", "opt_m", "opt_v"):
            host[k], device[k] = device[k], 0
        if layout.homes.update_on_host:  # fp32 grads, new m and v, new params (compiles agree)
            fp32_grads = _state_bytes(layout, layout.opt_specs, np.float32)
            host["temporaries"] = fp32_grads + host["opt_m"] + host["opt_v"] + params
    if "params" in layout.host_state:  # the decoder layers; embedding, final norm and LM head stay
        host["params"] = _state_bytes(layout, layout.param_specs, prec.param, part="layers")
        device["params"] -= host["params"]
    elif _itemsize(prec.grad_reduce) > _itemsize(prec.param) and layout.lora is None \
            and not cfg.optimizer.update_in_backward and planned_dtype("wq", cfg, prec) != prec.param:
        # (Where the projections' gradients are kept at the params' dtype, jaxmem.core.grad_dtype, only the norm
        # scales are cast: nothing to count.)
        # offload.cast_for_grad casts the whole decoder stack to the gradient dtype before the forward (its
        # gradient comes out in that dtype); from then on the donated bf16 layers are dead and XLA reuses
        # their bytes, so through the backward the layers are held at the gradient's width (`jaxmem explain`
        # of the H100 cases with fp32 gradients: "a copy of state['params']['layers']" in f32 at the peak,
        # 3.63 GiB for Llama-3.2-1B, 6.50 for the 8-layer 8B, and no bf16 layer weights).
        layers = _state_elems(layout, layout.param_specs, "layers")
        device["params_for_grad"] = layers * (_itemsize(prec.grad_reduce) - _itemsize(prec.param))
    elif layout.lora is not None and "params" not in layout.host_state \
            and planned_dtype("a", cfg, prec, sp=sizes["sp"]) != prec.param:
        # adapters whose gradient the step cannot keep at their dtype (in sequence tiles, summed over the tiles
        # in fp32): an fp32 copy of them beside the stored ones (`jaxmem explain` of the gpt-oss-20b QLoRA
        # recipe at 256K: each expert adapter's f32 copy from the cast and its bf16 original at the peak)
        device["params_for_grad"] = _state_elems(layout, layout.param_specs) * _itemsize(prec.grad_reduce)
    streamed = layout.homes.update_streamed and not cfg.optimizer.update_in_backward
    if "params" in layout.host_state:
        # The decoder layers' gradients go straight to the host with their weights, whatever runs the update
        # (compiled llama3-8b 1 x 4090 recipe, update streamed, and qwen2.5-7b 1 x H100, update on the host,
        # with jax 0.10.2, 0.11.2 and 0.12.0.1: the [L, ...] layer gradient buffers are host memory); only the
        # embedding / final norm / LM head gradients are device buffers.
        device["grads"] -= _state_bytes(layout, layout.grad_specs, prec.grad_reduce, part="layers")
        if layout.homes.update_on_host:
            # the rest go to the host update too; the compiled totals of both cases match without them
            # (explain: the LM head's bf16 gradient is live at the layer peak, the donated embedding is not)
            device["grads"] = 0
            if layout.lora is None:  # and the LM head's gradient stays in the compute dtype (explain: bf16)
                device["logits"] -= head_full * (_head_grad_itemsize(layout, prec) - cd)
        device["temporaries"] = host_params_layer_bytes(cfg, layout, prec)
        # the layer's weight gradients complete after the MLP's gate / up input gradients are dead
        device["working_set"] -= 2 * per_name[CN.MLP_GATE.value] * cd
    host["activations"] = sum(saved_host.values())
    update_phase = 0
    memory = _device_memory(cfg, device_memory)
    if streamed or ("opt" in layout.host_state and cfg.optimizer.update_in_backward):
        # in-backward: the embedding / final norm / LM head are updated after the backward, streamed alike
        update_phase = update_phase_bytes(cfg, layout, prec, device, memory)
    if streamed and "params" not in layout.host_state:
        device["temporaries"] += update_prefetch_bytes(cfg, layout, prec, device, memory)
    if not layout.host_state and not cfg.optimizer.update_in_backward:
        update_phase = plain_update_phase_bytes(cfg, layout, prec, device)
    attention_phase = 0
    if layout.kernels["attention"] != "xla":
        attention_phase = attention_phase_bytes(cfg, layout, per_name, cd)
    absent_in_loss = 0
    if "opt" in layout.host_state and "params" not in layout.host_state \
            and not cfg.optimizer.update_in_backward:
        absent_in_loss = _state_bytes(layout, layout.grad_specs, prec.grad_reduce, part="layers")
    absent_in_layers = 0
    if _rest_weights_dead_in_layers(cfg, layout, prec):  # the stored weights less the layers'
        absent_in_layers = params - _state_bytes(layout, layout.param_specs, prec.param, part="layers")
    return Bill(device, host, saved_dev, saved_host, sizes, notes, layout, attention_scratch=scores_working,
                absent_in_loss=absent_in_loss, absent_in_layers=absent_in_layers, update_phase=update_phase,
                moe_scratch=moe_scratch, attention_phase=attention_phase)


def host_params_layer_bytes(cfg: Config, layout: Layout, prec: Precision) -> int:
    """One layer's temporaries in the backward with its weights fetched from the host (offload.params=host):
    its gradient, in the weights' dtype (the fetch's cast to the gradient dtype transposes back to it)
    before it goes to the host; no rebuilt full-width layer is held with it (`jaxmem explain` of qwen2.5-7b
    widths, 1 x h100-80g: the layer's bf16 gradients and the MLP's [T, d_ff] values at the peak)."""
    return _state_bytes(layout, layout.param_specs, prec.param, part="layers") // cfg.model.n_layers


# XLA's GPU scheduler memory limit (gpu_hlo_schedule.cc GetSchedulerMemoryLimit): 80% of the device memory,
# less the device-resident arguments, times xla_gpu_memory_limit_slop_factor (95 by default).
SCHEDULER_MEMORY_FRACTION, SCHEDULER_SLOP = 0.80, 0.95


def _device_memory(cfg: Config, device_memory: int | None) -> int:
    if device_memory is not None:
        return device_memory
    from jaxmem.config.targets import TARGETS

    target = TARGETS.get(cfg.target.name or "")
    return target.hbm_bytes if target else 0


def in_backward_stream_bytes(cfg: Config, layout: Layout, prec: Precision, device_memory: int) -> int:
    """Device bytes of a host-resident state streamed through optimizer.update_in_backward's layer backward
    (offload.optimizer=host): the largest layer leaf's master, m and v brought in and their updated copies,
    and the next leaf's prefetched while that fits under XLA's scheduler limit. Read off deviceless H100
    compiles of small models, one device (d_model 512, 4 / 8 layers: over the device-resident state the
    compiled temporaries grow 28.9 MB at d_ff 1536, this gives 28.3; 6.1 MB at d_ff 512, this gives 9.4)."""
    _, layer_params = split_layers(layout.abstract_params)
    _, layer_specs = split_layers(layout.opt_specs)
    per_elem = sum(_itemsize(d) for d in _state_dtypes(prec))
    leaves = sorted((_shard_elems(x.shape, s, layout.mesh_sizes) // cfg.model.n_layers
                     for x, s in zip(jax.tree.leaves(layer_params), spec_leaves(layer_specs), strict=True)),
                    reverse=True)
    peak = 2 * leaves[0] * per_elem
    if len(leaves) > 1 and peak + leaves[1] * per_elem <= SCHEDULER_MEMORY_FRACTION * device_memory * SCHEDULER_SLOP:
        peak += leaves[1] * per_elem
    return peak


def update_phase_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int],
                       device_memory: int) -> int:
    """Device bytes at the peak of an optimizer update streamed from the host (state on the host, update on
    the device). The non-layer leaves (embedding, LM head, final norm) are updated whole, or a piece at a time
    with the layers' weights on the host too (_streamed_rest_elems; the figures below are of whole leaves,
    before that): at the largest one's update (compiled llama3-8b 1 x 4090 recipe, 8 and 32 layers, read
    with `jaxmem explain --dump-dir`, device buffers only) the device holds its fp32 master, m and v brought
    in, their three updated copies, its new bf16 weight, and every gradient not yet consumed (its own, the
    embedding's); activations, the layer phase and the old weights are dead. XLA's scheduler also prefetches the next
    leaf's state while that fits under its memory limit (`SCHEDULER_*`): on an 80 GB H100 all three
    copies (+5.87 GiB: 20.55 GiB compiled on the GPU), on a 24 GB RTX 4090 none (14.68 GiB)."""
    leaves = _streamed_rest_elems(layout)
    largest = leaves[0] if leaves else 0
    state = [largest * _itemsize(d) for d in _state_dtypes(prec)]
    # in pieces the new weights are written over the old ones, which stay live through the loop (optim.
    # _rest_in_chunks; explain of the 1 x 4090 recipe: the bf16 embedding and LM head, 1.96 GiB, at its
    # 6.12 GiB peak, with the gradients, a piece's state in and out and the next piece's state prefetched)
    weights = device["params"] if layout.rest_pieces else largest * _itemsize(prec.param)
    peak = device["grads"] + weights + 2 * sum(state)
    limit = _scheduler_limit(device, device_memory)
    for copy in ([leaves[1] * _itemsize(d) for d in _state_dtypes(prec)] if len(leaves) > 1 else []):
        if peak + copy > limit:
            break
        peak += copy
    return peak


def plain_update_phase_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int]) -> int:
    """Device bytes at the peak of the default update, state on the device (jaxmem.core.optim.layerwise_update):
    the layers are updated in place one at a time (one layer's fp32 temporaries, under the backward's peak),
    then the embedding, final norm and LM head, once the layers' gradients are dead: at the largest leaf's
    update the device holds the resident state, the non-layer gradients, that leaf's gradient widened to
    fp32 (the embedding's rows made a table: jaxmem.core.embed_grad) and its new weight (`jaxmem explain` of a
    4-layer d_model 1024 Llama-3 at seq 8192 on one H100, deviceless: the fp32 embedding gradient, the new
    bf16 embedding and the LM head's bf16 gradient at the peak)."""
    resident = sum(device[k] for k in ("params", "base", "master", "opt_m", "opt_v", "inputs"))
    largest = next(iter(_rest_leaf_elems(layout)), 0)
    widened = largest * 4 if embed_grad.applies(cfg, layout, prec) else 0
    return resident + _plain_grad_bytes(cfg, layout, prec, rest_only=True) + widened \
        + largest * _itemsize(prec.param)


def _rest_leaf_elems(layout: Layout) -> list[int]:
    """Elements per device of each non-layer leaf (embedding, final norm, LM head) as the optimizer state
    shards it, largest first: a streamed update moves them whole, one at a time."""
    rest, _ = split_layers(layout.abstract_params)
    rest_specs, _ = split_layers(layout.opt_specs)
    return sorted((_shard_elems(x.shape, s, layout.mesh_sizes)
                   for x, s in zip(jax.tree.leaves(rest), spec_leaves(rest_specs), strict=True)), reverse=True)


def _streamed_rest_elems(layout: Layout) -> list[int]:
    """_rest_leaf_elems as a streamed update moves them: a piece at a time where it cuts them
    (Layout.rest_pieces), each piece then a leaf's count-th."""
    chunks = layout.rest_pieces
    count = chunks[1] if chunks else 1
    return [elems // count for elems in _rest_leaf_elems(layout)]


def _state_dtypes(prec: Precision) -> list:
    """The optimizer state kept per weight: fp32 master (if any), Adam's m and v."""
    return ([np.float32] if prec.master else []) + [prec.moment, prec.moment]


def _scheduler_limit(device: dict[str, int], device_memory: int) -> float:
    """XLA's GPU scheduler memory limit for this step (SCHEDULER_*): the device's share less the arguments."""
    args = device["params"] + device["base"] + device["inputs"]
    return (SCHEDULER_MEMORY_FRACTION * device_memory - args) * SCHEDULER_SLOP


def update_prefetch_bytes(cfg: Config, layout: Layout, prec: Precision, device: dict[str, int],
                          device_memory: int) -> int:
    """Bytes of a streamed optimizer update (state on the host, weights on the device) that XLA's scheduler
    brings forward into the layers' backward while they fit under its memory limit: the first updated
    leaf's fp32 master, m and v (the largest non-layer leaf) and the buffer the layers' new weights are
    written into (`jaxmem explain` of the 1-GPU 128k recipe, jax 0.11.2: the LM head's three fp32 copies,
    5.87 GiB, and the new bf16 layer weights, 1.63 GiB, live at the device peak in the MLP backward)."""
    largest = next(iter(_streamed_rest_elems(layout)), 0)
    new_layers = _state_bytes(layout, layout.param_specs, prec.param, part="layers")
    prefetch = largest * sum(_itemsize(d) for d in _state_dtypes(prec)) + new_layers
    phase = sum(device.values())  # an upper bound of the backward's own peak
    return prefetch if phase + prefetch <= _scheduler_limit(device, device_memory) else 0


def _batch_row_elems(cfg: Config) -> int:
    """int32 elements of one batch row: seq_len + 1 tokens, or seq_len per record array (inputs, labels,
    and with packing segment ids and positions)."""
    from jaxmem.core.step_state import batch_keys

    keys = batch_keys(cfg)
    return cfg.train.seq_len + 1 if keys == ("tokens",) else len(keys) * cfg.train.seq_len


def _counter_bytes(cfg: Config, layout: Layout) -> int:
    """Replicated bookkeeping in the train state (step, optimizer counters, loss scale), read off the
    program's own state layout so it follows jaxmem.core.program."""
    from jaxmem.core.optim import make_optimizer
    from jaxmem.core.step_state import assemble_state

    prec = Precision.from_config(cfg.precision)
    state = jax.eval_shape(lambda p: assemble_state(cfg, prec, make_optimizer(cfg), p), layout.abstract_params)
    small = [x for k, x in state.items() if k not in ("params", "master", "opt")]
    small += [x for x in jax.tree.leaves(state["opt"]) if not jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(math.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(small))
