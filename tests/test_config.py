"""Config loading, overrides, and one-line errors that name the key."""
import glob
import math

import jax

import pytest

from flax import nnx

from jaxmem.config import ConfigError, load_config, to_dict
from jaxmem.model import abstract_model
from jaxmem.model.presets import PRESETS, PUBLISHED_PARAM_COUNTS, param_count


def test_defaults_and_overrides():
    cfg = load_config("configs/tiny.yaml", ["train.steps=7", "optimizer.lr=1e-3", "parallel.tp=2",
                                             "remat.names.mlp_up=offload", "out_dir=/tmp/x"])
    assert cfg.train.steps == 7 and cfg.optimizer.lr == 1e-3 and cfg.parallel.tp == 2
    assert cfg.remat.names == {"mlp_up": "offload"} and cfg.out_dir == "/tmp/x"
    assert cfg.model.d_model == PRESETS["tiny"]["d_model"]


def test_preset_fields_can_be_overridden():
    cfg = load_config(None, ["model.preset=llama3-8b", "model.n_layers=4"])
    assert cfg.model.n_layers == 4 and cfg.model.d_model == 4096 and cfg.model.vocab_size == 128256


@pytest.mark.parametrize("override, fragment", [
    (["train.stepz=3"], "train.stepz: unknown key"),
    (["nosuch.section=1"], "nosuch: unknown key"),
    (["train.steps=abc"], "train.steps: 'abc' is not an int"),
    (["train.steps=0"], "train.steps: must be > 0"),
    (["parallel.rules=zigzag"], "parallel.rules: 'zigzag' is not allowed; use one of 'fsdp', 'fsdp_tp', 'dp'"),
    (["parallel.zero_stage=4"], "parallel.zero_stage: 4 is not allowed"),
    (["parallel.fsdp=-1", "parallel.dp=-1"], "at most one of dp, fsdp, tp may be -1"),
    (["parallel.tp=0"], "parallel.tp: must be a positive size or -1"),
    (["model.preset=llama9"], "model.preset: 'llama9' is unknown"),
    (["model.n_kv_heads=3"], "model.n_kv_heads: 3 must divide model.n_heads=4"),
    (["precision.param_dtype=float8"], "precision.param_dtype: 'float8' is not allowed"),
    (["remat.preset=most"], "remat.preset: 'most' is unknown"),
    (["remat.names.not_a_name=device"], "remat.names.not_a_name: unknown checkpoint name"),
    (["remat.names.mlp_up=disk"], "remat.names.mlp_up: 'disk' is not allowed"),
    (["data.kind=text"], "data.path: required for data.kind=text"),
    (["data.kind=bin", "data.path=/no/such/file.bin"], "data.path: file /no/such/file.bin not found"),
    (["train.seq_len=100000"], "train.seq_len: 100000 exceeds model.max_seq_len"),
    (["kernels.loss=magic"], "kernels.loss: 'magic' is not allowed"),
    (["precision.loss_scale.enabled=true"], "loss scaling is for compute_dtype=float16 only"),
    (["train.steps"], "expected key=value"),
    (["train=3"], "train: expected a mapping"),
])
def test_bad_input_is_one_line_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", override)
    msg = str(e.value)
    assert fragment in msg and "\n" not in msg


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


def test_config_base_inheritance(tmp_path):
    (tmp_path / "child.yaml").write_text(f"base: {glob.os.path.abspath('configs/tiny.yaml')}\ntrain:\n  steps: 3\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.train.steps == 3 and cfg.train.seq_len == load_config("configs/tiny.yaml").train.seq_len


RUN_CONFIGS = sorted(p for p in glob.glob("configs/**/*.yaml", recursive=True) if "/sweeps/" not in p)


@pytest.mark.parametrize("path", RUN_CONFIGS)  # sweep specs are validated by tests/test_sweep.py
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert to_dict(cfg)["model"]["vocab_size"] > 0


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAM_COUNTS))
def test_param_counts_match_published(preset):
    cfg = load_config(None, [f"model.preset={preset}"])
    assert param_count(cfg.model) == PUBLISHED_PARAM_COUNTS[preset]
    leaves = jax.tree.leaves(nnx.split(abstract_model(cfg.model))[1])  # the real module, shapes only
    assert sum(math.prod(x.shape) for x in leaves) == PUBLISHED_PARAM_COUNTS[preset]
