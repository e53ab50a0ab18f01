"""The mixture of experts as a feature: its rules at load and the expert-parallel dispatch it adds to the
forward (jaxmem.moe.expert_parallel) where the mesh has an ep axis."""
from __future__ import annotations

import dataclasses

from jaxmem.config.schema import Config, ConfigError, NotYetSupported
from jaxmem.core.plugins import Feature
from jaxmem.moe.explain import refine
from jaxmem.moe.bill import BILL_TERMS
from jaxmem.mesh.axes import MeshAxis
from jaxmem.model.moe import expert_count, is_moe as model_is_moe
from jaxmem.moe import bill as bill_moe, cost, expert_parallel, search


def is_moe(cfg: Config) -> bool:
    """Whether the run's model is a mixture of experts."""
    return model_is_moe(cfg.model)


def check(cfg: Config) -> None:
    """Mixture of experts: expert parallelism's sizes, and the levers it does not take yet, by name."""
    m, ep = cfg.model, cfg.parallel.ep
    if ep < 1:
        raise ConfigError(f"parallel.ep: must be a positive size (no -1 fill), got {ep}")
    if ep > 1 and not m.n_experts:
        raise ConfigError(f"parallel.ep: {ep} needs a mixture of experts (model.n_experts > 0); "
                          "use 1 for a dense model")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor: must be >= 0 (0: dropless), got {m.moe_capacity_factor}")
    if not m.n_experts:
        return
    if m.n_experts % ep:
        raise ConfigError(f"model.n_experts: {m.n_experts} experts do not split evenly over parallel.ep={ep}")
    if m.moe_capacity_factor and ep == 1:
        raise NotYetSupported("model.moe_capacity_factor: caps the expert-parallel dispatch only; set "
                              "parallel.ep > 1 or 0 (dropless)")
    if m.moe_capacity_factor and cfg.remat.seq_tile > 0:
        raise NotYetSupported("remat.seq_tile: not with model.moe_capacity_factor > 0 yet (each sequence tile would "
                              "drop by its own capacity); set 0 (dropless) or remat.seq_tile=0")
    if ep > 1:  # the levers tested with a mixture of experts on one device's experts, not yet with ep
        refused = {"lora.rank": cfg.lora.rank > 0, "optimizer.update_in_backward": cfg.optimizer.update_in_backward,
                   "model.moe_biases": m.moe_biases}
        for key, on in refused.items():
            if on:
                raise NotYetSupported(f"{key}: not supported with expert parallelism (parallel.ep={ep}) yet; "
                                      "set parallel.ep=1 (the experts then shard over fsdp)")


class MixtureOfExperts(Feature):
    name = "moe"
    bill_terms = BILL_TERMS
    buffer_terms = (("refine", refine),)
    cost_breakdown_defaults = cost.BREAKDOWN_DEFAULTS
    cost_constants = cost.CONSTANTS

    def applies(self, cfg: Config) -> bool:
        return is_moe(cfg)

    def check(self, cfg: Config) -> None:
        check(cfg)

    def search_meshes(self, load, cfg: Config, n_devices: int) -> list[list[str]]:
        return search.ep_mesh_options(load, expert_count(cfg.model), n_devices)

    def expand_grid(self, grid: dict, load, cfg: Config, n_devices: int) -> dict:
        return search.expand_auto_ep(grid, load, expert_count(cfg.model), n_devices)

    def forward_context(self, cfg: Config, mesh, ctx):
        if mesh.shape.get(MeshAxis.EP.value, 1) > 1:
            return dataclasses.replace(ctx, experts=expert_parallel.dispatcher(mesh, cfg.model.moe_capacity_factor))
        return ctx

    def layer_flops(self, cfg: Config, tokens: int, ops: dict[str, float]) -> dict[str, float]:
        return cost.layer_flops(cfg, tokens, ops)

    def mlp_width_per_token(self, cfg: Config, width: int) -> int:
        return cost.mlp_width_per_token(cfg, width)

    def own_rate_matmuls(self, cfg: Config, bill, ops: dict, rebuilt: list[str], weight_passes: int):
        return cost.own_rate_matmuls(cfg, bill, ops, rebuilt, weight_passes)

    def collective_seconds(self, cfg: Config, bill, gpu, grad_accum: int) -> float:
        return cost.expert_parallel_seconds(cfg, bill, gpu, grad_accum)

    def zero3_gathered(self, cfg: Config, bill) -> tuple[int, float]:
        return cost.zero3_gathered(cfg, bill)

    def parameter_counts(self, cfg: Config, counts: dict[str, int]) -> dict[str, int]:
        return dict(counts, active=bill_moe.parameter_counts(cfg)["active"])


MOE = MixtureOfExperts()
