"""Training as a library: the loop (`run`), resuming, and the run's lifecycle in its out_dir (the lock, the
save clock, signals, a dead peer), evaluation and telemetry."""
from jaxmem.train.loop import (TrainError, compile_train_step, initial_state, parameter_counts,  # noqa: F401
                               resume_schedule, run)
from jaxmem.train import rl_loop  # noqa: F401 (registers the grpo loop in loop.OBJECTIVE_LOOPS)

__all__ = ["TrainError", "compile_train_step", "initial_state", "parameter_counts", "resume_schedule", "run"]
