"""Generation: a key/value cache, a prefill and a compiled decode loop, sampling (docs/generate.md)."""
