"""Sequence parallelism (`parallel.sp`) and sequence tiles (`remat.seq_tile`) as a feature."""
