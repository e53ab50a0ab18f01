"""Decoder-only transformer (Llama / Qwen2 / Mistral family)."""
from jaxmem.model.transformer import ForwardContext, Transformer, abstract_model, init_model  # noqa: F401
