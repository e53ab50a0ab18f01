"""The optimizer's hyper-parameters as the config sets them: the learning-rate schedule (warmup + cosine
decay) and which parameters take weight decay (not norms, not biases)."""
from __future__ import annotations

import jax
import optax

from jaxmem.config.schema import Config


def schedule_steps(cfg: Config) -> tuple[int, int]:
    """(warmup, decay) steps of the LR schedule: optimizer.decay_steps=0 means train.steps (GRPO: its optimizer
    steps, train.steps x rl.updates_per_rollout)."""
    o = cfg.optimizer
    updates = cfg.rl.updates_per_rollout if cfg.train.objective == "grpo" else 1
    decay = o.decay_steps or cfg.train.steps * updates
    return min(o.warmup_steps, max(decay - 1, 0)), decay


def schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optimizer
    warmup, decay = schedule_steps(cfg)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(decay, warmup + 1),
        end_value=o.lr * o.min_lr_ratio)


def decay_mask(params):
    """No weight decay on norms and biases (1-D per layer)."""

    def keep(path, x):
        last = str(getattr(path[-1], "key", path[-1]))
        return not (last.endswith("norm") or last in ("bq", "bk", "bv"))

    return jax.tree_util.tree_map_with_path(keep, params)
