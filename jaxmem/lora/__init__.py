"""LoRA / QLoRA foundations: adapter trees and merge (adapters), quantized base weights (quant), the frozen base
and the layer scan's view of it (frozen), the unmerged projections x W + s (x A) B (linear), PEFT files
(peft_format). The merged export is `merge(params, adapters, scale)` followed by jaxmem.io.hf.save_hf.

qwix (Google's JAX quantization and LoRA library) was evaluated: it rewrites Flax modules by patching their
ops (dot_general, einsum) at call time and creates its quantized / LoRA params inside that traced call, it
stores NF4 as one jnp.uint4 index per element with no double quantization, and its providers have no
handling for weights stacked on a leading layer dim and scanned (its one mention of scan is a custom_vjp
workaround). jaxmem's model keeps its layers stacked and scanned with per-layer fetch
hooks, logical-axis sharding and checkpoint-name tags, and the planner must count the stored bytes of every
leaf before anything runs, so this package keeps a small explicit quantizer whose leaves are plain arrays
with the layer dim leading.
"""
from jaxmem.lora.adapters import (TARGETS, adapter_axes, init_adapters, merge, resolve_targets, scale,
                                  target_weights)
from jaxmem.lora.peft_format import load_peft, save_peft
from jaxmem.core.quant import (NF4_CODES, dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4,
                               quantized_bytes)

__all__ = ["TARGETS", "adapter_axes", "init_adapters", "merge", "resolve_targets", "scale", "target_weights",
           "load_peft", "save_peft", "NF4_CODES", "dequantize_int8", "dequantize_nf4", "quantize_int8",
           "quantize_nf4", "quantized_bytes"]
