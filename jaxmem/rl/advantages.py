"""Advantages within each group of completions of one prompt (TRL's scale_rewards=group): the weighted reward
minus its group's mean, over the group's standard deviation (Bessel-corrected) + 1e-4. A group whose rewards
are all equal gives no signal: its advantages are 0 and it is counted."""
from __future__ import annotations

import numpy as np


def group_advantages(rewards_nf: np.ndarray, weights, group_size: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(advantages [N], total rewards [N], the share of groups with no signal) for N = groups x group_size rows
    ordered group by group."""
    total = (rewards_nf.astype(np.float64) * np.asarray(weights, np.float64)[None]).sum(axis=1)
    groups = total.reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(mean)
    advantages = (groups - mean) / (std + 1e-4)
    flat = np.isclose(std[:, 0], 0.0, atol=1e-8)
    return advantages.reshape(-1).astype(np.float32), total.astype(np.float32), float(np.mean(flat))
