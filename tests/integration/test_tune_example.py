"""docs/tune.md's example is what scripts/tune_example.py prints (a cold `jaxmem tune` of the Llama-3-8B recipe
for 8 x H100), and its winner fits its own compiled figure."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("tune_example", ROOT / "scripts" / "tune_example.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_example_is_the_scripts_output_and_its_winner_fits():
    pytest.importorskip("jax_cuda12_plugin")
    script = _script()
    block, result = script.run(workers=0)  # in this process: the suite's figure cache serves the compile
    assert script.current(script.DOC.read_text()) == block, (
        "docs/tune.md's example is stale; regenerate it with `python scripts/tune_example.py`")
    row = result["best"]["row"]
    assert row["fits"] is True and row["device_bytes_basis"] == "compiled"
    assert row["device_bytes"] <= row["usable_device_bytes"]
    lines = block.splitlines()
    header = next(i for i, line in enumerate(lines) if "levers (GiB per GPU" in line)
    candidates = lines[header:lines.index("path:")]
    assert len(candidates) >= 2 and all(len(line) <= 120 for line in candidates)  # one line each
