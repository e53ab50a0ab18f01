"""The user's reference: `--help` of every command, `jaxmem config`, `jaxmem list`, docs/config.md (kept in step
with the field descriptions in jaxmem/config/schema.py), `jaxmem --version`, and `jaxmem train` with no arguments."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from jaxmem import cli
from jaxmem.cli import config_cmd as reference
from jaxmem.config import Config, to_dict
from jaxmem.loader import load_config
from jaxmem.config.schema import field_docs

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
DOCS = ROOT / "docs" / "config.md"


def _leaf_keys() -> list[str]:
    return [key for key, *_ in reference._leaf_docs()]


def _strip_comments(text: str) -> str:
    return "\n".join(line.split("  # ", 1)[0] for line in text.splitlines())


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_command_has_a_full_help_with_an_example(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxmem " + command)
    description = out.split("\n\n")[1]
    assert len(description.split()) >= 8, f"{command}: description too short: {description!r}"
    assert description.rstrip().endswith((".", ")", "`")), f"{command}: description stops mid-sentence"
    examples = out.split("examples:\n", 1)
    assert len(examples) == 2, f"{command}: no examples section"
    assert f"jaxmem {command}" in examples[1], f"{command}: no example runs the command"


def test_top_level_usage_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"  {name} " in out
    assert "--version" in out


def test_version_names_jaxmem_and_jax(capsys):
    import jax

    import jaxmem

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert jaxmem.__version__ in out and f"jax {jax.__version__}" in out


def test_every_config_key_has_a_description():
    keys = [key for key, _, _ in field_docs()]
    assert len(keys) == len(set(keys))
    for key, _, text in field_docs():
        assert text and text.strip() == text and "\n" not in text, key
    # every section of Config and every field of it is walked
    expected = {f.name for f in dataclasses.fields(Config)}
    assert expected <= set(keys)
    assert "precision.loss_scale.min_scale" in keys and "remat.names" in keys


def test_docs_config_md_is_up_to_date():
    generated = reference.config_markdown()
    assert DOCS.is_file() and DOCS.read_text() == generated, (
        f"docs/config.md is stale (the field descriptions in jaxmem/config/schema.py changed); regenerate it with "
        f"`{reference.REGENERATE}`")


def test_docs_config_md_describes_every_key():
    text = DOCS.read_text()
    keys = _leaf_keys()
    assert len(keys) > 80
    for key in keys:
        row = re.search(r"^\| `" + re.escape(key) + r"` \|(.*)\|$", text, re.M)
        assert row, f"{key}: no row in docs/config.md"
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.group(1))]
        assert len(cells) == 3 and cells[-1], f"{key}: empty description in docs/config.md"


def test_remat_descriptions_name_every_preset_and_choice():
    from jaxmem.core import remat

    docs = {key: text for key, _, text in field_docs()}
    for name in remat.PRESETS:
        assert name in docs["remat.preset"]
    for choice in remat.CHOICES:
        assert choice in docs["remat.names"]
    assert "overrides the preset" in docs["remat.names"]


def test_literal_keys_name_their_allowed_values():
    import typing

    for key, f, text in field_docs():
        tp = typing.get_type_hints(reference._owner(key))[f.name]
        if typing.get_origin(tp) is typing.Literal:
            for value in typing.get_args(tp):
                assert str(value) in text, f"{key}: description does not mention {value!r}"


def test_config_diff_round_trips(capsys, tmp_path):
    assert cli.main(["config", str(TINY), "--diff"]) == 0
    out = capsys.readouterr().out
    assert "# " in out  # descriptions as comments
    assert "(default: " in out
    printed = yaml.safe_load(_strip_comments(out))
    cfg = load_config(TINY)
    assert printed == reference.differing(cfg)
    # the differing keys of the tiny config, as tiny.yaml gives them
    assert printed["train"]["steps"] == 60 and printed["checkpoint"]["keep"] == 2
    assert "model" not in printed and "remat" not in printed  # at their defaults
    # fed back, the printed keys (comments and all) are the same config
    path = tmp_path / "diff.yaml"
    path.write_text(out)
    assert load_config(path) == cfg


def test_config_full_output_round_trips_with_overrides(capsys, tmp_path):
    overrides = ["remat.preset=full", "remat.names.mlp_up=device", "model.preset=llama3-8b", "train.seq_len=256"]
    assert cli.main(["config", str(TINY), *overrides]) == 0
    out = capsys.readouterr().out
    cfg = load_config(TINY, overrides)
    assert yaml.safe_load(_strip_comments(out)) == to_dict(cfg)
    path = tmp_path / "full.yaml"
    path.write_text(out)
    assert load_config(path) == cfg
    # a key the preset fills is not a difference; the preset is
    diff = reference.differing(cfg)
    assert diff["model"] == {"preset": "llama3-8b"}
    assert diff["remat"] == {"preset": "full", "names": {"mlp_up": "device"}}


def test_config_without_a_file_prints_the_defaults(capsys):
    assert cli.main(["config", "--diff"]) == 0
    assert "every key is at its default" in capsys.readouterr().out


def test_config_markdown_prints_the_reference(capsys):
    assert cli.main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == reference.config_markdown()


@pytest.mark.parametrize("what, names", [
    ("presets", ["llama3-8b", "qwen2-72b", "tiny", "8.03B"]),
    ("remat", ["selective", "offload_selective", "attn_context", "mlp_gate"]),
    ("targets", ["h100-80g", "rtx4090-24g", "NVIDIA H200"]),
    ("kernels", ["chunked", "cudnn", "auto -> cudnn on gpu where the cuDNN library loads, else pallas (here: ",
                 "auto -> pallas on one gpu, blocked on several, blocked on cpu"]),
])
def test_list_names(what, names, capsys):
    assert cli.main(["list", what]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert name in out, f"jaxmem list {what}: {name!r} missing"


def test_list_covers_every_name(capsys):
    from jaxmem.core import remat
    from jaxmem.config.names import ALL_NAMES
    from jaxmem.model.presets import PRESETS
    from jaxmem.config.targets import TARGETS

    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in [*PRESETS, *remat.PRESETS, *ALL_NAMES, *TARGETS]:
        assert re.search(r"^\s+" + re.escape(name) + r"\s", out, re.M), name
    assert set(reference.CHECKPOINT_NAME_HELP) == set(ALL_NAMES)


def test_list_refuses_an_unknown_list(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["list", "gpus"])
    assert exc.value.code == 2
    assert "presets" in capsys.readouterr().err


def test_train_with_no_arguments_prints_help_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: jaxmem train") and "examples:" in out
    assert list(tmp_path.iterdir()) == []


def test_train_with_overrides_only_says_it_uses_the_tiny_config(capsys, monkeypatch):
    from jaxmem.cli import train

    seen = {}

    def fake_run(cfg):
        seen["cfg"] = cfg
        return {"records": [], "start_step": 0, "final_step": 0, "out_dir": cfg.out_dir}

    monkeypatch.setattr(train, "run", fake_run)
    assert cli.main(["train", "train.steps=3", "out_dir=runs/none"]) == 0
    err = capsys.readouterr().err
    assert "configs/tiny.yaml" in err and len([l for l in err.splitlines() if "no CONFIG" in l]) == 1
    assert seen["cfg"] == load_config(TINY, ["train.steps=3", "out_dir=runs/none"])
