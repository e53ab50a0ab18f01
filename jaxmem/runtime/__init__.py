"""JAX plumbing below everything else: version checks, the memory-kinds shim, deviceless targets, multi-process start, the OOM text predicate."""
