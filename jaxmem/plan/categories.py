"""Memory categories, in one place: what `jaxmem explain` calls a buffer of the compiled step, and which of
those each line of the analytic bill (`jaxmem.plan.bill`) estimates. No imports beyond the standard library:
the bill, explain and reports can all read it.
"""
from __future__ import annotations

# explain: what a buffer live at the peak is (jaxmem.plan.buffer_kinds classifies it).
#   param: the train state's weights, and copies of them (all-gathered, cast, sliced);
#   grad: gradients (the backward pass's, reduce-scattered, accumulated over micro-batches);
#   optimizer: optimizer state (m, v, fp32 master) and the update's temporaries;
#   activation: per-layer values a scan keeps for the backward pass;
#   logits: [tokens, vocab] (and its gradient);
#   temp: the rest (one op's working memory, the batch).
PARAM, GRAD, OPTIMIZER, ACTIVATION, LOGITS, TEMP = "param", "grad", "optimizer", "activation", "logits", "temp"
EXPLAIN_CATEGORIES = (PARAM, GRAD, OPTIMIZER, ACTIVATION, LOGITS, TEMP)

# The bill's device categories (jaxmem.plan.bill.CATEGORIES, in its display order) -> the explain category
# of the buffers each one estimates (where most of its bytes land).
BILL_TO_EXPLAIN: dict[str, str] = {
    "params": PARAM,
    "base": PARAM,  # LoRA: the frozen base weights, at their stored dtype (bf16, int8 or nf4)
    # the decoder layers cast to a wider gradient dtype for the backward (fp32 grads of bf16 weights): the
    # bytes beyond `params` (the stored layers are dead once cast, so this is the difference of the widths)
    "params_for_grad": PARAM,
    "grads": GRAD,
    "master": OPTIMIZER,  # fp32 master weights live in the optimizer's part of the state
    "opt_m": OPTIMIZER,
    "opt_v": OPTIMIZER,
    "inputs": TEMP,  # the batch (explain: an argument of the step that is not train state)
    "activations": ACTIVATION,
    "working_set": TEMP,  # one layer's recomputed values and their gradients during its backward
    "logits": LOGITS,
    "temporaries": GRAD,  # a layer's full gradient before its reduce-scatter, the fp32 micro-batch accumulator
}
# Where else explain can file bytes a bill category estimates, beyond BILL_TO_EXPLAIN (the bill lumps them):
#   logits: the LM head's gathered weight (param) and its gradient (grad);
#   temporaries: the all-gathered layer weights (param); with offload.optimizer_update=host, the update's
#   buffers (optimizer); working_set: activations the backward of a layer reads back (activation).
BILL_ALSO: dict[str, tuple[str, ...]] = {
    "logits": (PARAM, GRAD),
    "temporaries": (PARAM, OPTIMIZER),
    "working_set": (ACTIVATION,),
}


def explain_category(bill_category: str) -> str:
    """The explain category of a bill category (KeyError for a name the table does not know)."""
    return BILL_TO_EXPLAIN[bill_category]


def bill_categories(explain_cat: str) -> tuple[str, ...]:
    """The bill categories whose bytes explain files under `explain_cat` (mainly or in part)."""
    if explain_cat not in EXPLAIN_CATEGORIES:
        raise KeyError(explain_cat)
    return tuple(b for b, e in BILL_TO_EXPLAIN.items() if e == explain_cat or explain_cat in BILL_ALSO.get(b, ()))


# The levers that shrink a buffer, per explain category (and the finer keys explain uses): (what the buffer is,
# the alternatives). Each alternative names its levers as `key=value` (or `key>=value`); explain shows only
# those the config does not already use and that its validation accepts (jaxmem.plan.advice). `{name}`: the
# buffer's checkpoint name; `{param_dtype}`: the config's.
SUGGESTIONS = {
    "logits": ("[tokens, vocab] fp32 logits, which a fused loss never materializes",
               ("kernels.loss=chunked", "kernels.loss=pallas")),
    "scores": ("S x S attention scores",
               ("a flash kernel: kernels.attention=pallas", "a remat policy that does not save dots: "
                "remat.preset=full", "remat.preset=selective")),
    "param": ("parameters", ("shard them: parallel.zero_stage=3 with a larger fsdp axis", "offload.params=host")),
    "optimizer": ("optimizer state",
                  ("offload.optimizer=host", "precision.moment_dtype=bfloat16",
                   "precision.moment_dtype=int8 (quarters the moments, lossy: docs/optimizers.md)",
                   "precision.moment_dtype=int4", "precision.master_weights=false")),
    "optimizer_temp": ("optimizer update temporary (AdamW math, or a new copy of the state or params before it "
                       "replaces the old)",
                       ("offload.optimizer=host with offload.optimizer_update=host runs the update off the GPU",
                        "precision.moment_dtype=bfloat16 halves the moments",
                        "precision.moment_dtype=int8 quarters them (docs/optimizers.md)")),
    "optimizer_fetch": ("optimizer state streamed from pinned host memory for the update (offloaded, updated on "
                        "the device): XLA brings leaves forward while they fit under its scheduler limit",
                        ("optimizer.update_in_backward=true streams one layer's at a time",
                         "precision.moment_dtype=bfloat16 halves the moments",
                         "precision.moment_dtype=int8 quarters them (docs/optimizers.md)")),
    "param_copy": ("copy of the weights (cast, sliced or relaid out)",
                   ("precision.grad_reduce_dtype={param_dtype} needs no cast copy for the gradients",
                    "more sharding: parallel.zero_stage=3 with a larger fsdp axis")),
    "grad": ("gradients",
             ("parallel.zero_stage>=2 shards them", "precision.grad_reduce_dtype=bfloat16 halves them",
              "optimizer.update_in_backward=true with remat.preset=full keeps one layer's at a time")),
    "gathered": ("all-gathered full weight (FSDP)",
                 ("fewer layers gathered ahead (XLA's scheduler prefetch; a lower remat.every_k)",
                  "tensor parallelism (parallel.tp)")),
    "activation": ("scan residual '{name}' kept for every layer",
                   ("remat.names.{name}=remat (recompute)", "remat.names.{name}=offload", "remat.preset=full",
                    "remat.preset=offload_layer_inputs")),
    "activation_unnamed": ("per-layer scan residual",
                           ("a remat policy that saves less: remat.preset=full",
                            "offload it: remat.preset=offload_layer_inputs",
                            "parallel.sp splits it along the sequence")),
    "moe_expanded": ("MoE per-expert copy of the routed rows (jax.lax.ragged_dot lowered densely for the GPU, "
                     "experts x rows)",
                     ("fewer tokens per micro-batch (train.micro_batch, train.seq_len with grad_accum)",
                      "parallel.ep (rows split ep ways) once expert parallelism exists")),
    "moe_dispatch": ("MoE routed rows: with parallel.ep at 1 every device holds the whole micro-batch's tokens x "
                     "top-k",
                     ("parallel.ep splits them once expert parallelism exists", "fewer tokens per micro-batch")),
    "router_logits": ("MoE router logits (fp32, tokens x experts)", ("fewer tokens per micro-batch",)),
    "temp": ("temporary of one op",
             ("remat.seq_tile runs the per-token parts of a layer a tile at a time",
              "remat.granularity=segments shrinks the layer working set", "parallel.sp splits the sequence",
              "a fused kernel removes it")),
}
