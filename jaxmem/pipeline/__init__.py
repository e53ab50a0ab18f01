"""Pipeline parallelism (parallel.pp > 1): one program per stage; see docs/pipeline.md."""


def is_pipeline(prog) -> bool:
    """Whether `prog` is a pipeline program (jaxmem.pipeline.runtime.PipelineProgram), without importing it."""
    return getattr(prog, "counts", None) is not None
