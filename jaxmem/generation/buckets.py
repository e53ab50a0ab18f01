"""Static shapes from bucketed sizes: a prompt length or a token budget rounded up to the next bucket (powers of
two from MIN_BUCKET), and a batch's rows to the next power of two (a multiple of the mesh's data ways), so a new
length or batch size within a bucket reuses a compiled program."""
from __future__ import annotations

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The bucket holding n: the smallest power of two >= max(n, MIN_BUCKET)."""
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return size


def batch_bucket(rows: int, multiple: int = 1) -> int:
    """The rows a batch of `rows` is padded to: the smallest power of two >= rows, rounded up to a multiple of
    `multiple` (the mesh's data ways)."""
    size = 1
    while size < rows:
        size *= 2
    return -(-size // multiple) * multiple
