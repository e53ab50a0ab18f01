"""The frozen embedding table and LM head of a LoRA run, stored quantized (`lora.quantize_embeddings`).

Both are stored per vocab row, [V, D] (the LM head transposed), in `lora.base_dtype` (int8 with a scale per
row, or NF4 in blocks of 64 of each row, double-quantized scales as `lora.double_quant`), so every leaf has
the vocab on its first dim: the embedding gathers the rows of the tokens and dequantizes only those, and the
chunked loss slices a vocab chunk of rows and dequantizes [chunk, D] at a time (`QuantizedHead.columns`), so
neither is ever whole in bf16. They are frozen: no gradient, and the loss skips dW for a quantized head.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.core.quant import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from jaxmem.mesh.axes import constrain
from jaxmem.model.layers import ACT_BTD

NF4_BLOCK = 64


def store_rows(base_dtype: str, double_quant: bool, w_vd: jax.Array) -> dict:
    """A [V, D] table in its stored form, every leaf [V, ...]."""
    if base_dtype == "int8":
        return quantize_int8(w_vd, (1,))
    return quantize_nf4(w_vd, NF4_BLOCK, double_quant, batch_dims=1)


def store_table(setup, key: str, w: jax.Array) -> dict:
    """The stored form of the "embed" ([V, D]) or "lm_head" ([D, V], stored transposed) table."""
    return store_rows(setup.base_dtype, setup.double_quant, w.T if key == "lm_head" else w)


def unstore_rows(stored: dict, d: int, dtype) -> jax.Array:
    """[..., D] from stored rows whose leaves are [..., per row] (any leading dims: gathered or sliced rows)."""
    if "q" in stored:
        return dequantize_int8(stored, dtype)
    lead = stored["codes"].shape[:-1]
    return dequantize_nf4(stored, (*lead, d), dtype)


def embed_rows(stored: dict, tokens, d: int, dtype) -> jax.Array:
    """The embeddings [*tokens.shape, D] of `tokens`, dequantized from the gathered rows only."""
    return unstore_rows(jax.tree.map(lambda x: jnp.take(x, tokens, axis=0), stored), d, dtype)


def embed_tokens(stored: dict, tokens_bt, d: int, dtype) -> jax.Array:
    """What Transformer.embed_tokens computes, from the stored table: [B, T, D] in the compute dtype."""
    tokens_bt = constrain(tokens_bt, ACT_BTD[:2])
    return constrain(embed_rows(stored, tokens_bt, d, jnp.float32).astype(dtype), ACT_BTD)


@jax.tree_util.register_pytree_node_class
class QuantizedHead:
    """A frozen [D, V] LM head stored as rows [V, ...]; the chunked loss takes it where it takes w_dv."""

    def __init__(self, stored: dict, d: int, dtype):
        self.stored, self.d, self.dtype = stored, d, jnp.dtype(dtype)

    @property
    def shape(self) -> tuple[int, int]:
        return self.d, jax.tree.leaves(self.stored)[0].shape[0]

    def columns(self, start, size: int) -> jax.Array:
        """Columns [start, start + size) as [D, size] in the compute dtype (only those rows dequantized)."""
        rows = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=0), self.stored)
        return unstore_rows(rows, self.d, jnp.float32).T.astype(self.dtype)

    def zero_cotangent(self) -> "QuantizedHead":
        """The (zero) cotangent of a frozen head: float0 for the integer leaves."""
        zero = lambda x: (np.zeros(x.shape, jax.dtypes.float0) if jnp.issubdtype(x.dtype, jnp.integer)  # noqa: E731
                          else jnp.zeros_like(x))
        return jax.tree.map(zero, self)

    def tree_flatten(self):
        return (self.stored,), (self.d, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)
