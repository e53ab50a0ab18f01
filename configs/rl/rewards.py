"""Reward functions of the tiny arithmetic task (configs/rl/tiny-grpo.yaml, made by scripts/rl_example.py):
prompts "a plus b" with the record's `answer`, the digit a + b. TRL's convention: f(prompts, completions,
**fields) -> one float per completion."""


def correct(prompts, completions, answer, **fields):
    """1.0 when the completion's first word is the answer."""
    return [1.0 if c.split()[:1] == [a] else 0.0 for c, a in zip(completions, answer)]


def digit_first(prompts, completions, **fields):
    """1.0 when the completion starts with a digit (the answer's form), else 0."""
    return [1.0 if c.split()[:1] and c.split()[0].isdigit() else 0.0 for c in completions]
