"""Checkpoints by time as well as by steps (checkpoint.every_minutes), and the line a stopped run ends with."""
from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np


def agreed(flag: bool) -> bool:
    """Process 0's `flag` on every process (a one-int collective; every process must call it at the same step)."""
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


class SaveClock:
    """Says when `checkpoint.every_minutes` have passed since the last save (or the start); `0`: never.

    One process checks at every step. Several processes could read their clocks at different steps, so they
    check only when `check` is true (the train loop passes its log steps, the same on every process) and
    follow process 0's clock.
    """

    def __init__(self, minutes: float):
        self.period_s = float(minutes) * 60.0
        self.multi = jax.process_count() > 1
        self.last = time.monotonic()

    def due(self, check: bool = True) -> bool:
        if not self.period_s or (self.multi and not check):
            return False
        late = time.monotonic() - self.last >= self.period_s
        return agreed(late) if self.multi else late

    def saved(self) -> None:
        self.last = time.monotonic()


def stopped_line(summary: dict, checkpoints_enabled: bool) -> str:
    """The one line a run stopped by a signal ends with."""
    step, signal = summary["final_step"], summary["stopped_by"]
    if not checkpoints_enabled:
        return f"{signal}: stopped after step {step}; checkpoint.enabled=false, so nothing was saved"
    where = Path(summary["out_dir"]) / "checkpoints"
    return f"{signal}: saved step {step} to {where}; rerun the same command to resume"
