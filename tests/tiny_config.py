"""configs/tiny.yaml as a test runs it: its out_dir under the test's tmp_path, no progress bar."""
from pathlib import Path

from jaxmem.loader import load_config

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def tiny_config(tmp_path, *overrides):
    return load_config(TINY, [f"out_dir={tmp_path}", "train.progress=false", *overrides])


def shipped_config(path):
    """A shipped config as the tests load it: a tiny recipe whose checkpoint.init_from folder its page's example
    script writes (scripts/rl_example.py: rl_example/hf) is loaded without it (the folder is not in the tree)."""
    import yaml

    init_from = (yaml.safe_load(Path(path).read_text()).get("checkpoint") or {}).get("init_from") or ""
    written_by_example = str(init_from).split("/")[0].endswith("_example")
    return load_config(path, ['checkpoint.init_from=""'] if written_by_example else [])
