"""Pipeline parallelism (parallel.pp > 1): one program per stage; see docs/pipeline.md."""
