"""LoRA's plug-in (jaxmem.core.plugins): what a LoRA run changes in the train program and its checkpoints.

The state holds the adapters under "params" (the only trainable tree) and the frozen base beside them
(jaxmem.lora.frozen); the layer scan carries each layer's stored linears and adapters and the model reads
them through jaxmem.lora.linear's projection; with `lora.quantize_embeddings` the embedding and LM head are
read from their stored form (jaxmem.lora.frozen_vocab); with `lora.dropout` each micro-batch gets a key
(jaxmem.lora.dropout). A checkpoint saves the adapters and their optimizer state only, records which base
they belong to, and a resume rebuilds that base.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import FROZEN, ProgramPlugin
from jaxmem.core.step_state import assemble_state
from jaxmem.lora import frozen
from jaxmem.lora.frozen import LoraSetup
from jaxmem.lora.adapters import init_adapters
from jaxmem.lora.linear import grouped_project, project
from jaxmem.lora.dropout import with_keys
from jaxmem.lora.frozen_vocab import embed_tokens
from jaxmem.lora.frozen_vocab import QuantizedHead
from jaxmem.lora.dropout import step_key
from jaxmem.lora.load_base import stream_base, streams

META_KEY = "lora_base"  # a checkpoint's meta entry: lora_base_identity of the run that saved it


class LoraPlugin(ProgramPlugin):
    def __init__(self, setup: LoraSetup):
        self.setup = setup

    @classmethod
    def from_config(cls, cfg: Config) -> "LoraPlugin | None":
        setup = LoraSetup.from_config(cfg)
        return None if setup is None else cls(setup)

    # ------------------------------------------------------------ state layout
    def frozen_layout(self, layout) -> dict:
        return {FROZEN: (layout.frozen_abstract, layout.frozen_specs)}

    def fresh_state(self, prog, params, seed) -> dict:
        """The params become the frozen base and fresh adapters are trained."""
        state = adapter_state(prog, seed)
        state[FROZEN] = frozen.make_base(self.setup, prog.cfg, params, prog.precision.param)
        return state

    def seed_state(self, prog, seed):
        """Fresh adapters on the base from `seed`, its layers initialized and stored one at a time."""
        state = adapter_state(prog, seed)
        state[FROZEN] = frozen.base_from_seed(self.setup, prog.cfg, seed, prog.precision.param)
        return state

    def frozen_part(self, prog, load_params):
        """The frozen base, rebuilt where the config says: checkpoint.init_from (a Hugging Face directory or an
        import-hf output is streamed a layer at a time: jaxmem.lora.load_base), else the seed."""
        cfg, setup, out = prog.cfg, self.setup, prog.state_shardings[FROZEN]
        if cfg.checkpoint.init_from and streams(cfg.checkpoint.init_from):
            return stream_base(prog, cfg.checkpoint.init_from)
        if cfg.checkpoint.init_from:
            make = lambda p: frozen.make_base(setup, cfg, p, prog.precision.param)  # noqa: E731
            return jax.jit(make, out_shardings=out)(load_params(prog, cfg.checkpoint.init_from))
        return jax.jit(lambda: frozen.base_from_seed(setup, cfg, cfg.train.seed, prog.precision.param),
                       out_shardings=out)()

    def streams_state(self, path) -> bool:
        return streams(path)

    def streamed_state(self, prog, path):
        """An HF directory or import-hf output: the base streamed and quantized a layer at a time."""
        if not self.streams_state(path):
            return None
        rest = {k: v for k, v in prog.state_shardings.items() if k != FROZEN}
        state = jax.jit(lambda: adapter_state(prog), out_shardings=rest)()
        return dict(state, **{FROZEN: stream_base(prog, path)})

    donates_params = False  # the stored base cannot reuse the loaded params' buffers
    assembles_state = False  # adapters on a frozen base (its layers are seeded one at a time already)

    # ------------------------------------------------------------ forward
    def layer_fetch(self, cfg, layout, fetch):
        """The scan carries (layer state, stored base + adapters): jaxmem.lora.linear."""
        return frozen.fetch_fn(self.setup, frozen.layer_shapes(cfg, self.setup), cfg.lora.dropout)

    def forward_context(self, ctx):
        return dataclasses.replace(ctx, project=project, grouped=grouped_project)

    def check_mesh(self, mesh) -> None:
        if self.setup.quantize_embeddings and mesh.size > 1:
            raise ConfigError(f"lora.quantize_embeddings: needs one device (the mesh has {mesh.size})")

    def bind(self, prog, params, base, dropout_key, ctx):
        """params are the adapters: the scan hands each layer its frozen linears + adapters."""
        pieces = frozen.lora_layers(self.setup, base, params)
        if dropout_key is not None:
            pieces = with_keys(pieces, dropout_key, prog.cfg.model.n_layers)
        run_ctx = dataclasses.replace(ctx, scan_layers=lambda body, h, stacked: ctx.scan_layers(
            body, h, (stacked, pieces)))
        return frozen.model_params(self.setup, base), run_ctx

    def embed(self, prog, base, model, tokens, ctx):
        if not self.setup.quantize_embeddings:
            return super().embed(prog, base, model, tokens, ctx)
        return embed_tokens(base["embed"], tokens, prog.cfg.model.d_model, ctx.compute_dtype)

    def head_weight(self, prog, base, model):
        if not self.setup.quantize_embeddings:
            return super().head_weight(prog, base, model)
        cfg = prog.cfg
        return QuantizedHead(base["embed" if cfg.model.tie_embeddings else "lm_head"], cfg.model.d_model,
                             prog.precision.compute)

    # ------------------------------------------------------------ step
    def keys_micro_batches(self, cfg) -> bool:
        return cfg.lora.dropout > 0

    def micro_key(self, cfg, step, index):
        """From (seed, step, micro-batch) only: the remat recompute and a resume draw the same masks."""
        return step_key(cfg.train.seed, step, index)

    def reference_inputs(self, params, frozen):
        """The base alone: zero adapters add nothing to a projection (jaxmem.lora.linear), so the forward is
        the frozen base's, with no extra weights held."""
        return jax.tree.map(jax.numpy.zeros_like, params), frozen

    # ------------------------------------------------------------ checkpoints
    def meta(self, cfg) -> dict:
        return {META_KEY: lora_base_identity(cfg)}

    def check_meta(self, cfg, meta: dict, directory) -> None:
        want, saved = lora_base_identity(cfg), meta.get(META_KEY)
        if saved != want:
            raise ConfigError(f"{directory}: these adapters belong to the base '{saved}', this run's base is "
                              f"'{want}' (checkpoint.init_from, train.seed, lora.base_dtype); use the same base "
                              "or a new out_dir")


def adapter_state(prog, seed: int | None = None) -> dict:
    """A LoRA run's step-0 state without its base: fresh adapters, their optimizer state and master."""
    setup = prog.layout.lora
    seed = prog.cfg.train.seed if seed is None else seed
    adapters = init_adapters(prog.cfg.model, setup.targets, setup.rank, jax.random.key(seed + 1),
                             prog.precision.param)
    return assemble_state(prog.cfg, prog.precision, prog.optimizer, adapters)


def lora_base_identity(cfg: Config) -> str:
    """Which frozen base a LoRA run's adapters belong to: where the weights come from and how they are stored
    (a LoRA checkpoint holds the adapters and their optimizer state only)."""
    origin = f"init_from {Path(cfg.checkpoint.init_from).absolute()}" if cfg.checkpoint.init_from \
        else f"seed {cfg.train.seed}"
    lo = cfg.lora
    return f"{cfg.model.preset} {origin}, {lo.base_dtype}{' double-quantized' if lo.double_quant else ''}"
