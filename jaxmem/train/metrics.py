"""Where a run's metrics go: `metrics.jsonl`, a rich progress bar, optional TensorBoard."""
from __future__ import annotations

import json
import math
from pathlib import Path

from jaxmem.config.schema import ConfigError
from jaxmem.io.no_follow import link_refused, open_no_follow, write_text

# Every record of metrics.jsonl has these keys (times are wall-clock, measured on the
# host the run ran on, over the steps since the previous record).
REQUIRED_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "step_time_s")


class JsonlWriter:
    """Appends one JSON object per logged step. A run that starts at step `start` (a resume: the restored
    state's step; a fresh run: 0) first cuts the file back to the records up to it, so metrics agree with the
    state: the steps a crash lost after the last checkpoint, and a last line the crash tore, go. `cut` is the
    one line saying what was cut ("" when nothing was)."""

    def __init__(self, path: str | Path, start: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.cut = cut_back(self.path, start) if start is not None else ""
        self._file = open_no_follow(self.path, "a")  # never through a link

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def cut_back(path: Path, start: int) -> str:
    """Keeps the records of `path` up to step `start` (written whole, in place of the file, atomically); the
    one line saying what went, or ""."""
    if path.is_symlink():
        raise link_refused(path)
    if not path.is_file():
        return ""
    kept, later, torn = [], 0, 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            torn += 1  # a line a crash cut short (the next record was then appended to it)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start:
            kept.append(line)
        else:
            later += 1
    if not (later or torn):
        return ""
    staging = path.with_name(path.name + ".cut")
    write_text(staging, "".join(line + "\n" for line in kept))  # os.replace swaps names, never follows
    staging.replace(path)
    parts = [f"{count} {what}" for count, what in ((later, f"record{'s' * (later != 1)} after it"),
                                                   (torn, f"torn line{'s' * (torn != 1)}")) if count]
    return f"{path.name}: cut back to step {start}, the state the run starts from ({' and '.join(parts)} removed)"


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summary_writer_class():
    """tensorboardX's SummaryWriter, else torch's (needs the tensorboard package); ConfigError if neither."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("train.tensorboard: no TensorBoard writer is installed; pip install "
                              "jaxmem[tensorboard] (tensorboardX) or set train.tensorboard=false") from None
    return SummaryWriter


class TensorBoardWriter:
    """Scalars to TensorBoard event files under `log_dir`; a run starting at step `start` > 0 (a resume) has
    TensorBoard drop the events after it (purge_step)."""

    def __init__(self, log_dir: str | Path, start: int = 0):
        self._writer = summary_writer_class()(str(log_dir), purge_step=start + 1 if start else None)

    def write(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                group, name = ("eval", key[len("eval_"):]) if key.startswith("eval_") else ("train", key)
                self._writer.add_scalar(f"{group}/{name}", value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def wandb_available():
    """The wandb module; ConfigError naming train.wandb if it is not installed."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("train.wandb: the wandb package is not installed; pip install jaxmem[wandb] or "
                          "set train.wandb to empty") from None
    return wandb


class WandbWriter:
    """Scalars to a Weights & Biases run in `project` (WANDB_MODE=offline writes under out_dir/wandb only)."""

    def __init__(self, project: str, out_dir: str | Path, config: dict):
        wandb = wandb_available()
        self._run = wandb.init(project=project, dir=str(out_dir), config=config, resume="allow")

    def write(self, record: dict) -> None:
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._run.log(scalars, step=record["step"])

    def close(self) -> None:
        self._run.finish()


class ProgressBar:
    """A rich progress bar with loss, tokens/s and step time; `enabled=False` prints nothing (the loop then prints
    log_line itself). Meant for a terminal: where stdout is not one, the loop prints plain lines instead."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self._progress = None
        if not enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("loss {task.fields[loss]}  {task.fields[tps]} trained tok/s  {task.fields[step_time]} s/step"))
        self._task = self._progress.add_task("train", total=total, completed=start, loss="-", tps="-", step_time="-")
        self._progress.start()

    def advance(self, completed: int) -> None:
        if self._progress:
            self._progress.update(self._task, completed=completed)

    def show(self, record: dict) -> None:
        """Updates the bar's fields and prints the record's line above the bar."""
        if self._progress:
            self._progress.console.print(log_line(record), highlight=False, soft_wrap=True)  # one line, unwrapped
            self._progress.update(self._task, loss=_fmt(record["loss"], 4), tps=_fmt(record["tokens_per_sec"], 0),
                                  step_time=_fmt(record["step_time_s"], 3))

    def close(self) -> None:
        if self._progress:
            self._progress.stop()


def _fmt(value: float, digits: int) -> str:
    return f"{value:,.{digits}f}" if math.isfinite(value) else str(value)


def log_line(record: dict) -> str:
    """The plain one-line form of a record, for logs without a progress bar."""
    line = (f"step {record['step']}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
            f"lr {record['lr']:.2e}  {record['tokens_per_sec']:,.0f} trained tok/s")
    if "seen_tokens_per_sec" in record:  # every batch position, padding and untrained prompt tokens included
        line += f" ({record['seen_tokens_per_sec']:,.0f} seen)"
    line += f"  {record['step_time_s']:.3f} s/step"
    if "eval_loss" in record:
        line += f"  eval_loss {record['eval_loss']:.4f}"
        if "eval_ppl" in record:
            line += f"  eval_ppl {record['eval_ppl']:.2f}"
        if "eval_rewards/accuracies" in record:  # a preference objective's held-out pairs
            line += f"  eval_rewards/accuracies {record['eval_rewards/accuracies']:.3f}"
    return line
