"""LoRA's terms of the analytic bill (jaxmem.plan.bill): no weight gradient and no merged weight, the
frozen base at its stored dtype, fewer residuals without a checkpoint, a frozen (maybe quantized) LM head."""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.core.accounting import frozen_bytes, itemsize, state_elems
from jaxmem.core.grad_dtype import planned_dtype
from jaxmem.core.layout import Layout
from jaxmem.lora.adapters import target_weights


def largest_frozen_linear(cfg: Config, layout: Layout) -> int:
    """Per-device elements of a LoRA run's largest frozen linear of one layer as a matmul reads it: whole
    (FSDP gathers it), split over tensor parallelism."""
    return max(w.in_features * w.out_features for name, w in target_weights(cfg.model).items()
               if name in layout.part("lora").frozen) // layout.mesh_sizes["tp"]


def _state(d) -> None:
    d.trains_head, d.whole_model_grads, d.rest_donated = False, False, False  # the base is not donated: it stays
    d.head_gathered = not d.layout.part("lora").quantize_embeddings  # a stored head is never whole


def _activations(d) -> None:
    """No dW: `jaxmem explain` of QLoRA Llama-3-8B widths (seq 512, micro-batch 2, remat none, 4 layers,
    all-linear and q,v) shows no k before RoPE, and a projection's input only where its adapters' dA reads it
    (the attention context stays: the flash backward reads it)."""
    if d.layout.checkpointed:
        return
    d.saved_dev.pop("key_proj", None)
    for name, readers in (("mlp_act", ("w_down",)), ("attn_norm", ("wq", "wk", "wv")),
                          ("mlp_norm", ("w_gate", "w_up"))):
        if not set(readers) & set(d.layout.part("lora").targets):
            d.saved_dev.pop(name, None)


def _temporaries(d) -> None:
    """No weight gradient and no merged weight: a frozen linear is dequantized in the compute dtype where a
    matmul reads it, forward or backward (jaxmem.lora.linear), one at the peak (`jaxmem explain`, QLoRA
    Llama-3-8B widths, seq 512, remat none, 4 layers: one [d_model x d_ff] bf16 and its stored slice)."""
    cfg, layout, lora = d.cfg, d.layout, d.layout.part("lora")
    d.device["temporaries"] = largest_frozen_linear(cfg, layout) * (d.cd + 1) \
        + (2 * frozen_bytes(layout) // cfg.model.n_layers if d.gathered else 0)
    d.notes.append(f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: base stored as {lora.base_dtype}, "
                   "gradients and optimizer state for the adapters only")


def _host(d) -> None:
    """Adapters whose gradient the step cannot keep at their dtype (in sequence tiles, summed over the tiles in
    fp32): an fp32 copy of them beside the stored ones (`jaxmem explain` of the gpt-oss-20b QLoRA recipe at
    256K: each expert adapter's f32 copy from the cast and its bf16 original at the peak)."""
    layout, prec = d.layout, d.prec
    if "params" not in layout.host_state \
            and planned_dtype("a", d.cfg, prec, sp=layout.mesh_sizes["sp"]) != prec.param:
        d.device["params_for_grad"] = state_elems(layout, layout.param_specs) * itemsize(prec.grad_reduce)


BILL_TERMS = (("state", _state), ("activations", _activations), ("temporaries", _temporaries), ("host", _host))
