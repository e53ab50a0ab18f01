"""Optimizer lever: low-bit AdamW moments (block-wise codes), stochastic rounding to bf16, Adafactor."""
