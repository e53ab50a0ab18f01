"""configs/tiny.yaml as a test runs it: its out_dir under the test's tmp_path, no progress bar."""
from pathlib import Path

from jaxmem.loader import load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def tiny_config(tmp_path, *overrides):
    return load_config(TINY, [f"out_dir={tmp_path}", "train.progress=false", *overrides])
