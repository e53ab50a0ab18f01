"""Where each jaxmem parameter lives in a Hugging Face checkpoint: the model family's name map
(jaxmem.io.hf_families) and the tensor layouts (jaxmem.io.hf_tensors)."""
from __future__ import annotations

from jaxmem.io.hf_registry import family, family_for_config
from jaxmem.io.hf_tensors import ParamMap, hf_shape, merge_hf, read_slice, to_hf  # noqa: F401
from jaxmem.config.schema import ModelConfig


def param_maps(cfg: ModelConfig, architecture: str | None = None) -> list[ParamMap]:
    """Every parameter of the Transformer for `cfg`, in HF checkpoint order, as `architecture` names them
    (default: the family that holds `cfg`'s options)."""
    return (family(architecture) if architecture else family_for_config(cfg)).param_maps(cfg)
