"""Decoder-only transformer (Llama, Mistral, Qwen2, Qwen3 dense, Gemma 3 text; docs/models.md)."""
from jaxmem.model.transformer import ForwardContext, Transformer, abstract_model, init_model  # noqa: F401
