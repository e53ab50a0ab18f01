"""Static shapes from bucketed sizes: a prompt length or a token budget rounded up to the next bucket (powers of
two from MIN_BUCKET), and a batch's rows to the next power of two (a multiple of the mesh's data ways), so a new
length or batch size within a bucket reuses a compiled program."""
from __future__ import annotations

MIN_BUCKET = 16


def power_of_two_at_least(n: int, smallest: int) -> int:
    """The smallest power of two >= max(n, smallest), `smallest` a power of two."""
    size = smallest
    while size < n:
        size *= 2
    return size


def bucket(n: int) -> int:
    """The bucket holding n: the smallest power of two >= max(n, MIN_BUCKET)."""
    return power_of_two_at_least(n, MIN_BUCKET)


def batch_bucket(rows: int, multiple: int = 1) -> int:
    """The rows a batch of `rows` is padded to: the smallest power of two >= rows, rounded up to a multiple of
    `multiple` (the mesh's data ways)."""
    return -(-power_of_two_at_least(rows, 1) // multiple) * multiple
