"""Preference tuning's terms of the analytic bill (jaxmem.plan.bill). The pair's two sequences are two rows of
the micro-batch, or two segments of a packed row (the base terms count the rows, packed ones with their segment
ids and positions); a frozen reference copy is the state's frozen part (the layout's,
counted by the base state term); stored reference log-probs are one more batch array (counted with the inputs).
What is left: the per-token log-probs of policy and reference ([rows, T] fp32, never [tokens, vocab]) and the
reference forward, which runs under stop_gradient and keeps no residual for the backward."""
from __future__ import annotations

from jaxmem.config.preference import resolved_reference
from jaxmem.core.reference_copy import stored_bytes


def _loss(d) -> None:
    cfg, layout = d.cfg, d.layout
    rows = layout.rows // layout.data_ways
    tokens = rows * cfg.train.seq_len // layout.mesh_sizes["sp"]
    with_reference = resolved_reference(cfg) in ("base", "model")
    # the policy's log-probs and their cotangent, the reference's (a forward's), fp32 per token
    d.device["logits"] += tokens * 4 * (3 if with_reference else 2)
    p = cfg.preference
    copy = f"a frozen {p.reference_dtype} copy of the weights (the state's frozen part, its layers on the " \
           f"{p.reference_memory})"
    source = {"none": "no reference (none allocated)", "base": "the frozen LoRA base with the adapters off (no "
              "extra weights)", "precompute": "stored reference log-probs in the batch (no reference weights)",
              "model": copy}[resolved_reference(cfg)]
    rows = "pairs on adjacent rows" if cfg.data.packing == "none" else \
        f"whole pairs packed in rows (data.packing={cfg.data.packing}: a sequence a segment)"
    d.notes.append(f"train.objective={cfg.train.objective}: {rows}, per-token log-probs from the "
                   f"fused LM head (no [tokens, vocab] logits); reference: {source}")


def _reference_copy(d) -> None:
    """reference=model: the copy is the state's frozen part (the base state term counts it on the device in its
    stored form, bf16 / int8 / nf4); with reference_memory=host its stored linear weights move to the host's
    "base" and one layer of them comes to the device at a time in the reference forward (a working term's
    size, dequantized to bf16)."""
    cfg, layout = d.cfg, d.layout
    if resolved_reference(cfg) != "model" or cfg.lora.rank > 0 or layout.frozen_abstract is None:
        return
    if cfg.preference.reference_memory != "host":
        return
    on_host = stored_bytes(layout)
    d.device["base"] -= on_host
    d.host["base"] = d.host.get("base", 0) + on_host


BILL_TERMS = (("state", _reference_copy), ("loss", _loss))
