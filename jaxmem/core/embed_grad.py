"""The embedding table's gradient as the rows a step touched, not a [vocab, d_model] fp32 table.

The plain step differentiates the loss with respect to the whole table: the transpose of the lookup
scatter-adds each token's fp32 row gradient into zeros the table's size (vocab x d_model x 4 bytes),
and that buffer lives from the end of the backward to the end of the update. The default step instead
differentiates with respect to the looked-up rows (the layer stack's input) and keeps `RowGrad`: the step's
distinct token ids and, per id, the sum of its rows' gradients, added in token order as the scatter-add
does (the same fp32 values). The global norm reads the sums; the optimizer widens them into the table's
shape only for the update of that one leaf, after the layers' update, when their gradients are dead.

Used where it takes fewer bytes per device than the table's gradient shard (`applies`), the embedding is
not tied to the LM head, and the step is the plain one (no LoRA, layers on the device).
"""
from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jaxmem.mesh.sharding import spec_ways
from jaxmem.mesh import sharding
from jaxmem.mesh.axes import activation_rules
from jaxmem.model.transformer import Transformer
from jaxmem.model.moe import is_moe
from jaxmem.optim.rows import RowGrad, dense, densify, is_rows, map_values  # noqa: F401 (the gradient's form)


def applies(cfg, layout, prec) -> bool:
    """Whether the default step (its config, jaxmem.core.layout.Layout and precision) keeps the rows: where they
    take fewer bytes per device than the table's gradient shard (the sums counted whole on every device)."""
    # model.embed_scale (Gemma) multiplies the looked-up rows, so a row's gradient is not the table's; a mixture of
    # experts adds its router losses in the step's own loss function, which the rows' path does not run: left out
    if layout.freezes_model or cfg.offload.params == "host" or cfg.model.tie_embeddings \
            or cfg.model.embed_scale or is_moe(cfg.model) or cfg.optimizer.update_in_backward or "embed" not in layout.grad_specs:
        return False
    return rows_bytes(cfg, layout, prec) < table_bytes(cfg, layout, prec)


def rows_bytes(cfg, layout, prec) -> int:
    """Per device: the fp32 sums (whole) and this device's share of the rows' gradient (compute dtype)."""
    n, d = tokens_per_step(cfg, layout), cfg.model.d_model
    return n * d * 4 + n // layout.data_ways * d * np.dtype(prec.compute).itemsize


def table_bytes(cfg, layout, prec) -> int:
    """Per device: the table's gradient shard at grad_reduce_dtype."""
    shards = spec_ways(layout.grad_specs["embed"], layout.mesh_sizes)
    return cfg.model.vocab_size * cfg.model.d_model * np.dtype(prec.grad_reduce).itemsize // shards


def tokens_per_step(cfg, layout) -> int:
    return layout.grad_accum * layout.rows * cfg.train.seq_len


def lookup(prog, embed, inputs):
    """The model's own embedding of `inputs` by the table `embed` (Transformer.embed_tokens, under the
    program's activation rules)."""
    constrainer = sharding.activation_constrainer(sharding.RULE_TABLES[prog.cfg.parallel.rules], prog.mesh)
    with activation_rules(constrainer):
        return Transformer.embed_tokens(SimpleNamespace(embed=embed, cfg=prog.cfg.model), inputs, prog.ctx)


def from_rows(tokens, row_grads, vocab: int) -> RowGrad:
    """RowGrad of the lookup of `tokens` [...] whose outputs got the gradients `row_grads` [..., d]."""
    ids = tokens.reshape(-1)
    rows = row_grads.reshape(ids.shape[0], -1).astype(jnp.float32)
    uniq, inverse = jnp.unique(ids, size=ids.shape[0], fill_value=vocab, return_inverse=True)
    sums = jax.ops.segment_sum(rows, inverse.reshape(-1), num_segments=ids.shape[0])
    return RowGrad(uniq.astype(jnp.int32), sums, vocab)


def grad_fn(prog, after_embed):
    """fn(params without the embedding, embedding table, micro-batch, denominator) -> ((their gradients, the
    gradient of the looked-up rows), summed loss): the step's loss / denominator differentiated with respect
    to the params and the embedded rows, the table itself held constant. `after_embed`: the program's step
    from the embedded rows on (jaxmem.core.program.stage_fn(prog, first=False))."""

    def loss(params, rows, micro, denom, embed):
        loss_sum, _ = after_embed(dict(params, embed=embed), rows, *micro[1:])
        return loss_sum / denom, loss_sum

    grad = jax.grad(loss, argnums=(0, 1), has_aux=True)

    def fn(params, embed, micro, denom):
        return grad(params, lookup(prog, embed, micro[0]), micro, denom, embed)

    return fn
