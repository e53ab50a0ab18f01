"""GRPO: group relative policy optimization from reward functions (train.objective=grpo, the rl section)."""
