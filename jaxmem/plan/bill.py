"""The analytic per-device memory bill: model states, saved activations by checkpoint name, working set,
logits, temporaries and host-resident bytes, computed from the config alone (no compile).

`compute_bill` is a sum of terms: the base model's (a full fine-tune, here and in jaxmem.plan.bill_parts, with
its state where `offload.*` puts it: jaxmem.plan.bill_homes), then each active feature's (jaxmem.core.plugins.Feature.bill_terms, from the
registry), phase by phase (PHASES). A term reads and writes a `Draft`; a feature that changes what the base
step holds says so through the draft's flags (e.g. LoRA's frozen LM head has no gradient) rather than the
base terms naming the feature.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxmem import registry
from jaxmem import kernels
from jaxmem.config.schema import Config
from jaxmem.core.accounting import (abstract_train_state, frozen_bytes, head_grad_itemsize, itemsize, model_elems,
                                    opt_state_bytes, plain_grad_bytes, state_bytes, state_elems)
from jaxmem.core.grad_dtype import planned_dtype
from jaxmem.core.layout import Layout
from jaxmem.core.precision import Precision
from jaxmem.model.layers import ACT_BTD
from jaxmem.plan import bill_homes, bill_parts as parts
from jaxmem.plan.categories import BILL_TO_EXPLAIN

# Device-bill categories in display order (each named with its explain category in plan/categories.py);
# `host` holds the host-resident counterparts.
CATEGORIES = tuple(BILL_TO_EXPLAIN)
HOST_CATEGORIES = ("params", "master", "opt_m", "opt_v", "activations", "temporaries")
# The order the terms run in: within a phase the base model's term first, then each feature's.
PHASES = ("shapes", "state", "activations", "scores", "working", "temporaries", "loss", "accumulator", "host",
          "update", "attention", "absent")


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
    # Each feature's scratch inside working_set, by the feature's name: live only in that feature's own phase of
    # the layer's backward, without the attention's S x S copies and before the layer's full gradients and next
    # gathered layer (a mixture of experts: the experts' masked per-group copies in their weight-gradient
    # backward, jaxmem.moe.bill; Mixtral and Qwen3-30B-A3B widths, deviceless h100-80g: the state, these copies
    # and little else at the peak).
    feature_scratch: dict = dataclasses.field(default_factory=dict)
    # A flash kernel's attention backward (attention_phase_bytes): its own phase, beside working_set (the
    # MLP backward's); the larger with sequence tiles, where the MLP runs a tile at a time.
    attention_phase: int = 0
    # Elements per device of each checkpointed tensor of one layer, as the bill counted them (the features'
    # terms included: a mixture of experts' routed rows); the cost model reads them too.
    per_name: dict = dataclasses.field(default_factory=dict)
    # The step takes every weight's gradient at once (a feature may say not: LoRA's frozen model, the update in
    # the backward), so the update reads the gradients the bill holds (the cost model's update bytes).
    whole_model_grads: bool = True

    @property
    def layer_phase(self) -> int:
        """One layer's backward at its peak: the attention backward (working set with the S x S copies, or
        a flash kernel's phase), the MLP backward (working set without them, plus the gathered weights and
        full gradients), or a feature's own phase (a mixture of experts' backward, with its expanded rows, without
        the temporaries and the other features' scratch)."""
        d = self.device
        ws, attn = d["working_set"], self.attention_scratch
        scratch = sum(self.feature_scratch.values())
        phases = [ws - scratch, ws - attn - scratch + d["temporaries"], self.attention_phase]
        phases += [ws - attn - (scratch - own) for own in self.feature_scratch.values() if own]
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
                "feature_scratch": {k: int(v) for k, v in self.feature_scratch.items()},
                "attention_phase": int(self.attention_phase),
                "label": "estimated (analytic)"}


@dataclasses.dataclass
class Draft:
    """A bill while its terms run: the figures so far, the quantities several terms share, and what the
    features change about the base step (the flags)."""

    cfg: Config
    layout: Layout
    prec: Precision
    memory: int  # one GPU's bytes (XLA's scheduler limit follows it)
    device: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    host: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(HOST_CATEGORIES, 0))
    per_name: dict[str, int] = dataclasses.field(default_factory=dict)
    working_names: dict[str, int] | None = None  # per_name as the working set counts it (None: per_name)
    saved_dev: dict[str, int] = dataclasses.field(default_factory=dict)
    saved_host: dict[str, int] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    scores_working: int = 0
    feature_scratch: dict[str, int] = dataclasses.field(default_factory=dict)  # Bill.feature_scratch
    update_phase: int = 0
    attention_phase: int = 0
    absent_in_loss: int = 0
    absent_in_layers: int = 0
    gathered: bool = False  # FSDP gathers each layer's weights for use
    layer_full: int = 0  # per-device elements of one layer as the step uses it (gathered)
    head_full: int = 0  # the same for the LM head (the embedding, tied)
    # what the features change about the base step
    trains_head: bool = True  # the LM head gets a gradient (LoRA's frozen head: no)
    head_gathered: bool = True  # under FSDP the loss gathers the head whole (a quantized LoRA head: no)
    whole_model_grads: bool = True  # the step takes every weight's gradient at once (not LoRA, not in backward)
    layer_elems_not_gathered: int = 0  # of layer_full, elements FSDP never gathers (experts sharded over ep)
    gathers_layer_whole: bool = False  # a layer is gathered whole and its gradient double-buffered (experts)
    grad_through_layers: bool = True  # the naive loss's logits gradient lives through the layers' backward
    layers_on_host: bool = False  # the decoder layers' weights live in pinned host memory
    rest_donated: bool = True  # the stored embedding / LM head are donated to the update and rewritten
    plain_update: bool = True  # the default update, state on the device, after the backward
    update_in_layers: bool = False  # the layers are updated inside the backward

    @property
    def cd(self) -> int:
        """Bytes of the compute dtype."""
        return itemsize(self.prec.compute)


def compute_bill(cfg: Config, n_devices: int, gpu: bool = True, layout: Layout | None = None,
                 device_memory: int | None = None) -> Bill:
    """Analytic per-device bill for `cfg` sharded over `n_devices` GPUs (or, with gpu=False, CPU devices:
    `auto` kernels resolve differently). Every decision comes from `layout` (default: resolved here).
    `device_memory` (bytes of one GPU; default: cfg.target.name's) only sets how much of a streamed
    optimizer update XLA's scheduler prefetches."""
    features = registry.for_config(cfg)
    layout = layout or registry.resolve_layout(cfg, n_devices, "gpu" if gpu else "cpu")
    draft = Draft(cfg, layout, Precision.from_config(cfg.precision), parts.device_memory_of(cfg, device_memory))
    feature_terms = features.terms("bill_terms")
    for phase in PHASES:
        BASE_TERMS[phase](draft)
        if phase in bill_homes.TERMS:  # where the state lives: every run's, after the base model's
            bill_homes.TERMS[phase](draft)
        for term_phase, term in feature_terms:
            if term_phase == phase:
                term(draft)
    d = draft
    return Bill(d.device, d.host, d.saved_dev, d.saved_host, layout.mesh_sizes, d.notes, layout,
                attention_scratch=d.scores_working, absent_in_loss=d.absent_in_loss,
                absent_in_layers=d.absent_in_layers, update_phase=d.update_phase, feature_scratch=d.feature_scratch,
                attention_phase=d.attention_phase, per_name=d.per_name, whole_model_grads=d.whole_model_grads)


# ---------------------------------------------------------------- the base model's terms


def _shapes(d: Draft) -> None:
    d.per_name = parts.name_shapes(d.cfg, d.layout)


def _state(d: Draft) -> None:
    cfg, layout, prec = d.cfg, d.layout, d.prec
    state = abstract_train_state(cfg, layout, prec)
    opt_m, opt_v = opt_state_bytes(layout, state)  # the moments as the optimizer stores them (optim.kind)
    accum, rows = layout.grad_accum, layout.rows
    d.device.update(
        params=state_bytes(layout, layout.param_specs, prec.param), base=frozen_bytes(layout),
        grads=plain_grad_bytes(cfg, layout, prec),  # cast to fp32 on use
        master=state_bytes(layout, layout.opt_specs, np.float32) if prec.master else 0, opt_m=opt_m, opt_v=opt_v,
        inputs=accum * (rows // layout.data_ways) * parts.batch_row_elems(cfg) * 4 + parts.counter_bytes(state))


def _activations(d: Draft) -> None:
    cfg, layout, per_name, cd, n_layers = d.cfg, d.layout, d.per_name, d.cd, d.cfg.model.n_layers
    if layout.checkpointed:
        d.saved_dev = {n: per_name[n] * cd * n_layers for n, w in layout.saved.items() if w == "device"}
    else:
        d.saved_dev = {k: v * n_layers for k, v in parts.no_checkpoint_residuals(per_name, cd, cfg.model).items()}
    d.saved_host = {n: per_name[n] * cd * n_layers for n, w in layout.saved.items() if w == "host"}


def _scores(d: Draft) -> None:
    layout = d.layout
    scores_saved, d.scores_working = kernels.attention_bytes(layout.kernels["attention"],
                                                             parts.score_elems(d.cfg, layout), d.cd)
    if layout.keeps_scores:
        d.saved_dev["attention_scores"] = scores_saved * d.cfg.model.n_layers
        d.notes.append("plain XLA attention keeps the S x S scores of every layer (use a flash kernel or a "
                       "policy that does not save dots)")
    d.device["activations"] = sum(d.saved_dev.values())


def _working(d: Draft) -> None:
    """One layer's backward: its forward intermediates come back (recomputed or saved) plus their gradients,
    and plain-XLA attention's S x S copies. At the attention backward's peak `jaxmem explain` shows fp32
    probs, fp32 probs gradient and the bf16 scores gradient (10 bytes per element); the bool mask (the 11th
    byte of the kernel's scratch formula) lives only in the forward, where no gradient is live yet."""
    cfg, layout, m = d.cfg, d.layout, d.cfg.model
    if d.scores_working:
        d.scores_working -= parts.score_elems(cfg, layout) * 1  # the pred mask, forward only
    names = d.per_name if d.working_names is None else d.working_names
    working = parts.working_elems(cfg, layout, names) * d.cd + d.scores_working
    if layout.kernels["loss"] == "naive" and d.grad_through_layers:
        # The naive loss's fp32 logits gradient (the take_along_axis scatter-add, [tokens, vocab] per
        # device): with the optimizer update on the device XLA schedules the LM head's weight-gradient dot
        # after the layer scan, so this buffer stays live through every layer's backward (`jaxmem explain`:
        # input_scatter_fusion, live across the backward while loop). With the optimizer on the host that
        # dot runs before the scan.
        tokens = layout.per_device_elems(ACT_BTD[:2], (layout.rows, cfg.train.seq_len))
        vocab = layout.per_device_elems(("act_vocab",), (m.vocab_size,))
        working += tokens * vocab * 4
    d.device["working_set"] = working
    d.device["logits"] = parts.logits_bytes(cfg, layout)


def _temporaries(d: Draft) -> None:
    """A layer's full weight gradients (one device: written whole, then stored), and under FSDP its weights
    all-gathered in the compute dtype. A dense layer under FSDP: each weight's gradient is reduce-scattered
    as its dot makes it and the weights are gathered one by one, so at the MLP backward's peak at most the
    layer's gathered weights are held, no whole gradient (`jaxmem explain`, 8 x h100-80g FSDP, full remat). A
    layer a feature gathers whole (experts) holds it and its whole gradient, both double-buffered."""
    cfg, layout, m, cd = d.cfg, d.layout, d.cfg.model, d.cd
    d.gathered = cfg.parallel.zero_stage == 3 and layout.data_ways * layout.mesh_sizes["sp"] > 1
    d.layer_full = model_elems(layout, "layers") // m.n_layers - d.layer_elems_not_gathered
    d.head_full = model_elems(layout, "embed" if m.tie_embeddings else "lm_head")
    layer_grad = itemsize(planned_dtype("w_gate", cfg, d.prec))  # a projection's gradient (jaxmem.core.grad_dtype)
    if d.gathered and not d.gathers_layer_whole:
        d.device["temporaries"] = d.layer_full * cd
    else:
        d.device["temporaries"] = 2 * d.layer_full * layer_grad + (2 * d.layer_full * cd if d.gathered else 0)


def _loss(d: Draft) -> None:
    """The LM head's whole gradient in the loss's backward, and its gathered weight under FSDP."""
    if d.trains_head:
        d.device["logits"] += d.head_full * head_grad_itemsize(d.layout, d.prec)
    if d.gathered and d.head_gathered:
        d.device["logits"] += d.head_full * d.cd


def _accumulator(d: Draft) -> None:
    if d.layout.grad_accum > 1:
        d.device["temporaries"] += state_bytes(d.layout, d.layout.grad_specs, np.float32)  # fp32 accumulator


def _host(d: Draft) -> None:
    """Where the projections' gradients are kept at a wider dtype than the params (jaxmem.core.grad_dtype),
    offload.cast_for_grad casts the whole decoder stack to it before the forward: from then on the donated
    layers are dead and XLA reuses their bytes, so through the backward the layers are held at the gradient's
    width (`jaxmem explain` with fp32 gradients: "a copy of state['params']['layers']" in f32 at the peak and
    no bf16 layer weights). Only the norm scales are cast where the projections keep the params' dtype."""
    cfg, layout, prec = d.cfg, d.layout, d.prec
    if not d.layers_on_host and d.whole_model_grads and itemsize(prec.grad_reduce) > itemsize(prec.param) \
            and planned_dtype("wq", cfg, prec) != prec.param:
        layers = state_elems(layout, layout.param_specs, "layers")
        d.device["params_for_grad"] = layers * (itemsize(prec.grad_reduce) - itemsize(prec.param))
    d.host["activations"] = sum(d.saved_host.values())


def _update(d: Draft) -> None:
    if d.plain_update:
        d.update_phase = parts.plain_update_phase_bytes(d.cfg, d.layout, d.prec, d.device)


def _attention(d: Draft) -> None:
    if d.layout.kernels["attention"] != "xla":
        d.attention_phase = parts.attention_phase_bytes(d.cfg, d.layout, d.per_name, d.cd)


def _absent(d: Draft) -> None:
    """The stored embedding / final norm / LM head weights are dead through the layers' backward where the
    step donates them and the loss reads them last, and the update writes fresh ones from the fp32 master
    without reading the old (no fp16 loss scaling, whose skipped step keeps them; features that keep them
    say so: rest_donated). `jaxmem explain` of a full fine-tune on one h100-80g: the embedding's and the LM
    head's buffers end before the layers' backward peaks."""
    if d.rest_donated and d.prec.master and not d.cfg.precision.loss_scale.enabled:
        d.absent_in_layers = d.device["params"] - state_bytes(d.layout, d.layout.param_specs, d.prec.param,
                                                              part="layers")


BASE_TERMS = {"shapes": _shapes, "state": _state, "activations": _activations, "scores": _scores,
              "working": _working, "temporaries": _temporaries, "loss": _loss, "accumulator": _accumulator,
              "host": _host, "update": _update, "attention": _attention, "absent": _absent}
