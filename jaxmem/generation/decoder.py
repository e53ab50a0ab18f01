"""What the decode loop calls: a model's forward over a key/value cache, for the last token's logits.

`Decoder.from_model` runs a plain model's params; `Decoder.from_program` runs a train program's state through
its plug-in's hooks (jaxmem.core.plugins: bind, layer_fetch, embed, head_weight), so a LoRA run decodes with
its adapters unmerged and a QLoRA base dequantized per layer as in training, without this package naming LoRA.
Both are pure in their `weights` argument: a rollout inside a train program passes the state it holds.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmem.core import offload
from jaxmem.core.plugins import FROZEN, ProgramPlugin
from jaxmem.mesh import sharding
from jaxmem.mesh.axes import activation_rules
from jaxmem.model.cached import run_layers_cached
from jaxmem.model.seq_tiling import run_whole
from jaxmem.model.transformer import ForwardContext, take_rows
from jaxmem.config.schema import ModelConfig


def _plain_fetched_scan(fetch: Callable) -> Callable:
    """scan_layers without remat (no backward through generation), each layer's slice through `fetch`."""
    def scan_layers(body, carry, stacked):
        return jax.lax.scan(lambda c, s: (body(c, fetch(s)), None), carry, stacked)[0]

    return scan_layers


def generation_context(ctx: ForwardContext, fetch: Callable = lambda s: s) -> ForwardContext:
    """A training context made for generation: the same kernels and projections, a plain layer scan, no
    sequence tiling, no remat segments."""
    return dataclasses.replace(ctx, scan_layers=_plain_fetched_scan(fetch), segment=lambda name, fn: fn,
                               per_token=run_whole, per_token_tiled=False, lookup=take_rows)


def _head_matrix(w) -> jax.Array:
    """[D, V] from a head weight or a stored one that hands out its columns (a quantized head)."""
    return w.columns(0, w.shape[1]) if hasattr(w, "columns") else w


@dataclasses.dataclass(frozen=True)
class Decoder:
    """forward(weights, tokens_bt, positions_bt, cache, segment_ids_bt, prefill) -> (logits [B, V] fp32 of the
    last token, cache)."""

    cfg: ModelConfig
    compute_dtype: Any
    forward: Callable

    @classmethod
    def from_model(cls, model: nnx.Module, ctx: ForwardContext | None = None) -> "Decoder":
        """A plain model (jaxmem.load_hf, init_model): weights are its params as a pure dict
        (`Decoder.weights_of(model)`)."""
        graphdef = nnx.graphdef(model)
        ctx = generation_context(ctx or ForwardContext())

        def forward(weights, tokens_bt, positions_bt, cache, segment_ids_bt, prefill):
            m = nnx.merge(graphdef, weights)
            h = m.embed_tokens(tokens_bt, ctx)
            h, cache = run_layers_cached(m, h, ctx, positions_bt, cache, segment_ids_bt=segment_ids_bt,
                                         prefill=prefill)
            h = m.final_hidden(h[:, -1:], ctx)
            w = m.lm_head_weight().astype(ctx.compute_dtype)
            return jnp.einsum("BTD,DV->BV", h, w, preferred_element_type=jnp.float32), cache

        return cls(model.cfg, ctx.compute_dtype, forward)

    @staticmethod
    def weights_of(model: nnx.Module) -> dict:
        return nnx.to_pure_dict(nnx.state(model))

    @classmethod
    def from_program(cls, prog) -> "Decoder":
        """A train program (jaxmem.core.program.TrainProgram): weights are (state["params"], state's frozen
        part or None) (`Decoder.weights_of_state(state)`); runs under the program's activation sharding rules."""
        cfg, plugin = prog.cfg, prog.plugin or ProgramPlugin()
        fetch = plugin.layer_fetch(cfg, prog.layout, offload.layer_fetch(cfg, prog.precision.compute))
        ctx = generation_context(prog.ctx, fetch)
        constrainer = sharding.activation_constrainer(sharding.RULE_TABLES[cfg.parallel.rules], prog.mesh)

        def forward(weights, tokens_bt, positions_bt, cache, segment_ids_bt, prefill):
            params, base = weights
            params, run_ctx = plugin.bind(prog, params, base, None, ctx)
            m = nnx.merge(prog.graphdef, params)
            with activation_rules(constrainer):
                h = plugin.embed(prog, base, m, tokens_bt, run_ctx)
                h, cache = run_layers_cached(m, h, run_ctx, positions_bt, cache, segment_ids_bt=segment_ids_bt,
                                             prefill=prefill)
                h = m.final_hidden(h[:, -1:], run_ctx)
            w = _head_matrix(plugin.head_weight(prog, base, m)).astype(run_ctx.compute_dtype)
            return jnp.einsum("BTD,DV->BV", h, w, preferred_element_type=jnp.float32), cache

        return cls(cfg.model, prog.precision.compute, forward)

    @staticmethod
    def weights_of_state(state: dict) -> tuple:
        return state["params"], state.get(FROZEN)
