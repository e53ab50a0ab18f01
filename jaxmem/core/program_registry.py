"""Which train program a run's config asks for: a pipeline (parallel.pp > 1: one program per stage,
jaxmem.pipeline.runtime) or one TrainProgram; both satisfy jaxmem.core.plugins.RunProgram."""
from __future__ import annotations

from jaxmem.config.schema import Config
from jaxmem.core.program import build_program


def build_run_program(cfg: Config):
    """The program `jaxmem train` runs for `cfg` on all the attached devices."""
    if cfg.parallel.pp > 1:
        from jaxmem.pipeline.balance import stage_counts  # imported on demand: a pipeline's modules
        from jaxmem.pipeline.runtime import build_pipeline

        return build_pipeline(cfg, counts=stage_counts(cfg))
    return build_program(cfg)
