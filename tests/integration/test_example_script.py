"""scripts/train_example.py: a user's own loop on the library's pieces runs and round-trips a checkpoint."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_env import cpu_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_example_script_trains_and_restores(tmp_path):
    env = cpu_env(8)
    cmd = [sys.executable, "scripts/train_example.py", "configs/tiny.yaml", f"out_dir={tmp_path}",
           "train.steps=12", "train.seq_len=32"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"^step \d+  loss ([\d.]+)$", out.stdout, re.M)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.3  # it really trained
    assert f"restored step 12 from {tmp_path}/checkpoints: identical" in out.stdout
    assert (tmp_path / "checkpoints" / "12").is_dir()
