"""The optimizer state kinds' registry (jaxmem.optim.states): the schema takes its values and rules, the docs'
table is its own, and no module outside jaxmem/optim and jaxmem/config branches on a kind's name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jaxmem.config.schema import ConfigError, field_docs
from jaxmem.loader import load_config
from jaxmem.optim import states
from jaxmem.optim.kind import StateKind, state_kind

ROOT = Path(__file__).resolve().parents[2]


def test_docs_table_is_the_registry():
    text = states.DOCS.read_text()
    assert text == states.with_docs_table(text), (
        f"docs/optimizers.md's table of state kinds is stale; regenerate it with `{states.REGENERATE}`")
    for kind in states.KINDS:
        assert f"| `{kind.name}` |" in text


def test_schema_values_and_help_come_from_the_registry():
    help_text = next(text for key, _, text in field_docs() if key == "precision.moment_dtype")
    for kind in states.KINDS:
        assert kind.describe() in help_text
        assert state_kind(load_config("configs/tiny.yaml", [f"precision.moment_dtype={kind.name}"])).moment == kind.name
    with pytest.raises(ConfigError, match=r"^precision.moment_dtype: 'int5' is not allowed; use one of float32, "):
        load_config("configs/tiny.yaml", ["precision.moment_dtype=int5"])


@pytest.mark.parametrize("overrides,message", [
    (["precision.moment_block=64"], "precision.moment_block: blocks are for quantized moments"),
    (["precision.moment_dtype=int4", "precision.moment_block=65"], "need a multiple of 2"),
    (["optimizer.name=adafactor", "precision.moment_dtype=bfloat16"], "bfloat16 is for AdamW's moments"),
    (["precision.moment_block=-1"], "must be >= 0"),
])
def test_each_kind_brings_its_config_rule(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", overrides)


def test_state_kind_reads_the_registry():
    kind = state_kind(load_config("configs/tiny.yaml", ["precision.moment_dtype=int8"]))
    assert (kind.block, kind.bits, kind.checkpoint_id) == (2048, 8, "adamw/int8/2048")
    assert kind.moment_bytes_per_value() == (1 + 4 / 2048, 1 + 4 / 2048)
    assert kind.host_update_seconds_per_param == states.moment_kind("int8").host_update_rate
    assert kind.fused_host and not kind.restores("adamw/float32") and kind.restores("adamw/int8/2048")
    assert not kind.restores("adamw/int8/256")
    fp32, bf16 = StateKind("adamw", "float32", 0), StateKind("adamw", "bfloat16", 0)
    assert fp32.restores("adamw/bfloat16") and bf16.restores("adamw/float32") and not fp32.restores("adamw/int4/128")
    assert not fp32.restores("adafactor/float32")
    adafactor = StateKind("adafactor", "float32", 0)
    assert adafactor.host_update_seconds_per_param == fp32.host_update_seconds_per_param
    assert not adafactor.fused_host and adafactor.moment_bytes_per_value() == (0, 0)


def _kind_branches(path: Path, root: Path = ROOT) -> list[str]:
    """Lines of `path` where a comparison, a subscript or a .get() reads `.moment_dtype` or a StateKind's
    `.moment` (a branch on a kind's name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        reads = []
        if isinstance(node, ast.Compare):
            reads = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            reads = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            reads = node.args[:1]
        if any(isinstance(r, ast.Attribute) and r.attr in ("moment_dtype", "moment") for r in reads):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_branch_on_a_kind_name_outside_optim_and_config():
    outside = [p for p in sorted((ROOT / "jaxmem").rglob("*.py"))
               if p.parent.name not in ("optim", "config")]
    assert len(outside) > 100
    branches = [line for p in outside for line in _kind_branches(p)]
    assert not branches, f"branches on an optimizer state kind's name (ask jaxmem.optim.kind instead): {branches}"


def test_the_branch_check_finds_branches(tmp_path):
    source = ('low = p.moment_dtype in ("int8", "int4")\nrate = RATES[kind.moment]\nx = D.get(p.moment_dtype, 4)\n'
              'label = f"{p.moment_dtype} codes"\n')
    probe = tmp_path / "probe.py"
    probe.write_text(source)
    assert [line.rsplit(":", 1)[1] for line in _kind_branches(probe, tmp_path)] == ["1", "2", "3"]
