"""A pipeline (`parallel.pp` > 1) as a feature: its rules, its run program (one program per stage), the
checkpoints of its layout that a one-program run re-cuts and its plan, per stage (jaxmem.pipeline.plan)."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core import remat
from jaxmem.core.plugins import Feature
from jaxmem.pipeline.checkpoints import StagedLayout
from jaxmem.pipeline.partition import layer_counts
from jaxmem.pipeline.balance import stage_counts
from jaxmem.pipeline.plan import pipeline_plan
from jaxmem.pipeline.plan_render import render_pipeline
from jaxmem.pipeline.runtime import build_pipeline


def check(cfg: Config) -> None:
    """parallel.pp: the layer counts per stage, and the levers a pipeline does not take (yet), by name."""
    if cfg.parallel.pp == 1:
        return
    counts = layer_counts(cfg)  # "parallel.pp_layers: ..." on a bad list
    for k in counts or ():
        remat.group_size(cfg.remat, k)  # every_k groups must divide each stage's layers
    refused = {"lora.rank": cfg.lora.rank > 0, "optimizer.update_in_backward": cfg.optimizer.update_in_backward,
               "precision.loss_scale.enabled": cfg.precision.loss_scale.enabled,
               "offload.params": cfg.offload.params != "device",
               # a stage's layers do not know their number in the whole model, which picks local or global
               "model.global_every": cfg.model.global_every > 0}
    for key, on in refused.items():
        if on:
            raise ConfigError(f"{key}: not supported with parallel.pp > 1 yet; use pp=1 for this lever")


class Pipeline(Feature):
    name = "pipeline"
    foreign_layouts = (StagedLayout,)

    def applies(self, cfg: Config) -> bool:
        return cfg.parallel.pp > 1

    def check(self, cfg: Config) -> None:
        check(cfg)

    def run_program(self, cfg: Config, features):
        return build_pipeline(cfg, counts=stage_counts(cfg, features=features), features=features)

    def plan_run(self, cfg: Config, features, topo, planner, *, compile: bool, source: str) -> dict:
        return pipeline_plan(cfg, features, topo, planner, compile=compile, source=source)

    def render_plan(self, plan: dict, console) -> None:
        render_pipeline(plan, console)


PIPELINE = Pipeline()
