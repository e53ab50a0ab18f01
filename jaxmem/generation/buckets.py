"""Static shapes from bucketed lengths: a prompt length or a token budget rounded up to the next bucket, so a
new length reuses a compiled program (powers of two from MIN_BUCKET)."""
from __future__ import annotations

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The bucket holding n: the smallest power of two >= max(n, MIN_BUCKET)."""
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return size
