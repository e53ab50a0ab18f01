"""A Hugging Face folder is a model: `checkpoint.init_from` naming one with no model section gives the run the
folder's architecture (LoRA, QLoRA and a full fine-tune alike; `jaxmem train`, `plan` and `tune` load configs the
same way), a full fine-tune starts from the folder's weights, and model keys that disagree with the folder are
listed in one error line."""
import dataclasses
import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_parity import saved_checkpoints

from jaxmem import cli
from jaxmem.config import ConfigError
from jaxmem.core.checkpoint import init_from
from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.io.hf import load_hf
from jaxmem.io.hf_config import model_config_from_hf

CASES = {
    "qwen3": transformers.Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300, max_position_embeddings=256, rope_theta=1000000.0, tie_word_embeddings=False),
    "gemma3": transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300, max_position_embeddings=256, query_pre_attn_scalar=16, sliding_window=8,
        sliding_window_pattern=3),
}
# A config with no model section: the folder gives it.
CONFIG = """\
train: {steps: 3, micro_batch: 1, seq_len: 32, log_every: 1, progress: false}
optimizer: {warmup_steps: 0}
data: {kind: synthetic}
checkpoint: {every: 0}
"""


def _build(name):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CASES[name]).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {name: directory for name, (directory, _) in saved_checkpoints(tmp_path_factory, CASES, _build).items()}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def _folder_model(folder):
    return model_config_from_hf(json.loads((folder / "config.json").read_text()))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("extra", [[], ["lora.rank=16"], ["lora.rank=16", "lora.base_dtype=nf4"]])
def test_the_folder_gives_the_model(folders, config, name, extra):
    cfg = load_config(config, [f"checkpoint.init_from={folders[name]}", *extra])
    assert cfg.model == _folder_model(folders[name])
    assert cfg.model.vocab_size == 300 and cfg.model.d_model == 64


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_jaxmem_train_trains_the_folders_architecture_with_lora(folders, config, name, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(["train", str(config), f"out_dir={out}", f"checkpoint.init_from={folders[name]}",
                     "lora.rank=16"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert abs(losses[0] - np.log(300)) < 0.5  # the folder's 300-token vocabulary, its random weights
    resolved = load_config(out / "config.resolved.yaml")
    assert resolved.model == _folder_model(folders[name])


@pytest.mark.parametrize("name", list(CASES))
def test_a_full_fine_tune_starts_from_the_folders_weights(folders, config, name):
    cfg = load_config(config, [f"checkpoint.init_from={folders[name]}"])
    state = init_from(build_program(cfg), folders[name])
    want = nnx.to_pure_dict(nnx.split(load_hf(folders[name]))[1])
    got = jax.tree.map(np.asarray, state["params"])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(np.asarray, want))


def test_model_keys_that_disagree_with_the_folder_are_one_line(folders, config):
    folder = folders["qwen3"]
    with pytest.raises(ConfigError) as e:
        load_config(config, [f"checkpoint.init_from={folder}", "model.d_model=128", "model.n_layers=5",
                             "model.vocab_size=300", "model.max_seq_len=64"])
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"checkpoint.init_from: {folder / 'config.json'}")
    assert "model.d_model=128 (the folder: 64)" in text and "model.n_layers=5 (the folder: 2)" in text
    assert "vocab_size" not in text and "max_seq_len" not in text  # agrees / a run choice
    with pytest.raises(ConfigError, match=r"model\.preset=tiny sets vocab_size=256 \(the folder: 300\), d_model"):
        load_config(config, [f"checkpoint.init_from={folder}", "model.preset=tiny"])
    # keys that agree, and the run's own choices (max_seq_len), are taken
    cfg = load_config(config, [f"checkpoint.init_from={folder}", "model.d_model=64", "model.max_seq_len=64"])
    assert cfg.model == dataclasses.replace(_folder_model(folder), max_seq_len=64)


def test_a_config_built_in_code_is_checked_against_the_folder(folders, config):
    cfg = load_config(config, [f"checkpoint.init_from={folders['qwen3']}"])
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_ff=128))
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from: .*config\.json describes a model with d_ff=96 "
                                          r"\(the run: model\.d_ff=128\)"):
        init_from(build_program(other), folders["qwen3"])


def test_jaxmem_plan_takes_a_folder_with_no_model_section(folders, config, capsys):
    assert cli.main(["plan", str(config), f"checkpoint.init_from={folders['gemma3']}", "lora.rank=16",
                     "--no-compile"]) == 0
    out = capsys.readouterr().out
    params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(load_hf(folders["gemma3"]))))
    assert f"{params:,} params" in out
