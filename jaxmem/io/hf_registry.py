"""The Hugging Face family registry: every family adapter (jaxmem.io.hf_families, the dense ones, and
jaxmem.io.hf_families_moe, the mixtures of experts) by its `architectures` name, and the lookups."""
from __future__ import annotations

from jaxmem.config.schema import ConfigError, ModelConfig
from jaxmem.io.hf_families import (_OPTIONS, Gemma3Family, LlamaFamily, MistralFamily, Qwen2Family,
                                   Qwen3Family)
from jaxmem.io.hf_families_moe import MOE_FAMILIES

FAMILIES: dict[str, LlamaFamily] = {}


def register(family) -> None:
    FAMILIES[family.architecture] = family


for _family in (LlamaFamily(), MistralFamily(), Qwen2Family(), Qwen3Family(), Gemma3Family(), *MOE_FAMILIES):
    register(_family)


def family(architecture: str) -> LlamaFamily:
    if architecture not in FAMILIES:
        raise ConfigError(f"architecture: {architecture!r} is not supported; use one of {', '.join(FAMILIES)}")
    return FAMILIES[architecture]


def family_for_config(cfg: ModelConfig) -> LlamaFamily:
    """The first registered family whose checkpoints hold `cfg` (Llama before Mistral: same tensors)."""
    for fam in FAMILIES.values():
        if fam.expresses(cfg):
            return fam
    raise ConfigError("model: no Hugging Face family holds this combination of "
                      f"{', '.join(f'{k}={getattr(cfg, k)!r}' for k in _OPTIONS)}")
