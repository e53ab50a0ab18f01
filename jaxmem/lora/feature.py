"""LoRA as a feature: its rules at load, its part of the layout (the adapters as the trainable trees, the
frozen base beside them) and its program hooks (jaxmem.lora.plugin)."""
from __future__ import annotations

import math

import jax

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import Feature
from jaxmem.lora.bill import BILL_TERMS
from jaxmem.core.precision import Precision
from jaxmem.lora import frozen
from jaxmem.lora.adapters import adapter_axes, adapter_param_count, init_adapters, resolve_targets
from jaxmem.lora.frozen import LoraSetup
from jaxmem.lora.plugin import LoraPlugin
from jaxmem.mesh import sharding


def check(cfg: Config) -> None:
    lo = cfg.lora
    if lo.rank < 0:
        raise ConfigError(f"lora.rank: must be >= 0 (0: full fine-tune), got {lo.rank}")
    if lo.rank == 0:
        return
    if not (math.isfinite(lo.alpha) and lo.alpha > 0):
        raise ConfigError(f"lora.alpha: must be a finite number > 0, got {lo.alpha}")
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout: must be in [0, 1), got {lo.dropout}")
    if lo.dropout > 0 and cfg.remat.seq_tile > 0:
        raise ConfigError("lora.dropout: > 0 does not combine with remat.seq_tile yet (each tile would draw the "
                          "same mask); set remat.seq_tile=0 or lora.dropout=0")
    resolve_targets(lo.targets, model=cfg.model)  # "lora.targets: 'x' is not a target; use some of ..."
    if cfg.optimizer.update_in_backward or cfg.offload.params == "host":
        raise ConfigError("lora.rank: LoRA does not combine with optimizer.update_in_backward or offload.params=host "
                          "yet (the frozen base stays on the device, quantized if you like: lora.base_dtype)")
    par = cfg.parallel
    if lo.quantize_embeddings and (lo.base_dtype == "bfloat16" or cfg.kernels.loss != "chunked"
                                   or max(par.dp, par.fsdp, par.tp, par.sp, par.pp) > 1):
        raise ConfigError("lora.quantize_embeddings: needs lora.base_dtype int8 or nf4, kernels.loss=chunked and one "
                          f"device (got base_dtype={lo.base_dtype}, kernels.loss={cfg.kernels.loss})")
    if lo.quantize_embeddings and cfg.model.embed_scale:
        raise ConfigError("lora.quantize_embeddings: not with model.embed_scale (Gemma) yet: the quantized "
                          "embedding lookup does not scale by sqrt(d_model); set it to false")


def layout_part(cfg: Config, sizes: dict[str, int], trainable: dict) -> dict | None:
    """A LoRA run's part of the layout: the adapters' trees per ZeRO stage as the trainable ones, the frozen base
    in its stored form (quantized leaves) and its specs, and the setup as `layout.part("lora")`."""
    setup = LoraSetup.from_config(cfg)
    if setup is None:
        return None
    prec = Precision.from_config(cfg.precision)
    adapters = jax.eval_shape(lambda: init_adapters(cfg.model, setup.targets, setup.rank, jax.random.key(0),
                                                    prec.param))
    base = jax.eval_shape(lambda p: frozen.make_base(setup, cfg, p, prec.param), trainable["abstract_params"])
    rules = sharding.RULE_TABLES[cfg.parallel.rules]
    mesh = sharding.shape_only_mesh(sizes)
    axes = adapter_axes(setup.targets)

    def specs(table):
        return jax.tree.map(lambda names, x: sharding.logical_to_spec(names, table, mesh, x.shape), axes, adapters,
                            is_leaf=lambda x: isinstance(x, tuple))

    sharded, replicated = specs(rules), specs(sharding.without_data_axes(rules))
    stage = cfg.parallel.zero_stage
    return dict(abstract_params=adapters, param_specs=sharded if stage == 3 else replicated,
                grad_specs=sharded if stage >= 2 else replicated, opt_specs=sharded, gathered_specs=replicated,
                frozen_abstract=base, part=setup,
                frozen_specs=frozen.base_specs(setup, cfg, trainable["param_specs"], base, sizes))


class Lora(Feature):
    name = "lora"
    bill_terms = BILL_TERMS

    def applies(self, cfg: Config) -> bool:
        return cfg.lora.rank > 0

    def check(self, cfg: Config) -> None:
        check(cfg)

    def layout_part(self, cfg: Config, sizes: dict[str, int], trainable: dict):
        return layout_part(cfg, sizes, trainable)

    def program_plugin(self, cfg: Config):
        return LoraPlugin.from_config(cfg)

    def extra_trained_params(self, cfg: Config) -> int:
        """The adapters' elements (the cost model's 6 FLOPs per element and token; the frozen model's 4)."""
        return adapter_param_count(cfg.model, resolve_targets(cfg.lora.targets), cfg.lora.rank)


LORA = Lora()
