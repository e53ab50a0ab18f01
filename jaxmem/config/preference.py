"""Config-only rules of preference tuning that the data (jaxmem.io) and the feature (jaxmem.preference) share."""
from __future__ import annotations

REFERENCE_FREE = ("orpo", "simpo")  # objectives that compare with no reference policy


def resolved_reference(cfg) -> str:
    """preference.reference with auto decided: none (sft, orpo, simpo), base (LoRA), precompute or model."""
    if cfg.train.objective == "sft" or cfg.train.objective in REFERENCE_FREE:
        return "none"
    if cfg.preference.reference == "auto":
        return "base" if cfg.lora.rank > 0 else "precompute"
    return cfg.preference.reference
