"""Preference tuning's terms of the analytic bill (jaxmem.plan.bill). The pair's two sequences are two rows of
the micro-batch (the base terms count them); a frozen reference copy is the state's frozen part (the layout's,
counted by the base state term); stored reference log-probs are one more batch array (counted with the inputs).
What is left: the per-token log-probs of policy and reference ([rows, T] fp32, never [tokens, vocab]) and the
reference forward, which runs under stop_gradient and keeps no residual for the backward."""
from __future__ import annotations

from jaxmem.config.preference import resolved_reference


def _loss(d) -> None:
    cfg, layout = d.cfg, d.layout
    rows = layout.rows // layout.data_ways
    tokens = rows * cfg.train.seq_len // layout.mesh_sizes["sp"]
    with_reference = resolved_reference(cfg) in ("base", "model")
    # the policy's log-probs and their cotangent, the reference's (a forward's), fp32 per token
    d.device["logits"] += tokens * 4 * (3 if with_reference else 2)
    source = {"none": "no reference (none allocated)", "base": "the frozen LoRA base with the adapters off (no "
              "extra weights)", "precompute": "stored reference log-probs in the batch (no reference weights)",
              "model": "a frozen bf16 copy of the weights (the state's frozen part)"}[resolved_reference(cfg)]
    d.notes.append(f"train.objective={cfg.train.objective}: pairs on adjacent rows, per-token log-probs from the "
                   f"fused LM head (no [tokens, vocab] logits); reference: {source}")


BILL_TERMS = (("loss", _loss),)
