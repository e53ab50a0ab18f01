"""Config loading, overrides, and one-line errors that name the key."""
import glob
import math

import jax

import pytest

from flax import nnx

from jaxmem.config import ConfigError, to_dict

from jaxmem.loader import load_config
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
    (["parallel.fsdp=-1", "parallel.dp=-1"], "at most one of dp, fsdp, sp, tp may be -1"),
    (["parallel.tp=0"], "parallel.tp: must be a positive size or -1"),
    (["model.preset=llama9"], "model.preset: 'llama9' is unknown"),
    (["model.n_kv_heads=3"], "model.n_kv_heads: 3 must divide model.n_heads=4"),
    (["precision.param_dtype=float8"], "precision.param_dtype: 'float8' is not allowed"),
    (["remat.preset=most"], "remat.preset: 'most' is unknown"),
    (["remat.names.not_a_name=device"], "remat.names.not_a_name: unknown checkpoint name"),
    (["remat.names.mlp_up=disk"], "remat.names.mlp_up: 'disk' is not allowed"),
    (["data.kind=text"], "data.path: required for data.kind=text"),
    (["data.kind=jsonl", "data.path=chats.jsonl"], "data.tokenizer: required for data.kind=jsonl"),
    (["data.format=messages"], "data.format: messages needs records"),
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


@pytest.mark.parametrize("path", RUN_CONFIGS)  # sweep specs are validated by tests/integration/test_sweep.py
def test_every_shipped_config_validates(path):
    from tiny_config import shipped_config

    cfg = shipped_config(path)
    assert to_dict(cfg)["model"]["vocab_size"] > 0


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAM_COUNTS))
def test_param_counts_match_published(preset):
    cfg = load_config(None, [f"model.preset={preset}"])
    assert param_count(cfg.model) == PUBLISHED_PARAM_COUNTS[preset]
    leaves = jax.tree.leaves(nnx.split(abstract_model(cfg.model))[1])  # the real module, shapes only
    assert sum(math.prod(x.shape) for x in leaves) == PUBLISHED_PARAM_COUNTS[preset]


# ---------------------------------------------------------------- one pass at load (jaxmem.config.validate)

# One bad override per validator; load_config must refuse each (nothing here builds a program).
BAD_SECTION = {
    "model": (["model.n_kv_heads=3"], "model.n_kv_heads: 3 must divide model.n_heads=4"),
    "train": (["train.grad_accum=-1"], "train.global_batch / train.grad_accum: must be >= 0"),
    "optimizer": (["optimizer.b2=1"], "optimizer.b2: must be in [0, 1), got 1.0"),
    "parallel": (["parallel.dp=-2"], "parallel.dp: must be a positive size or -1 (fill), got -2"),
    "precision": (["precision.loss_scale.enabled=true"], "loss scaling is for compute_dtype=float16 only"),
    "data": (["data.workers=-1"], "data.workers: must be >= 0"),
    "checkpoint": (["checkpoint.keep=0"], "checkpoint.every must be >= 0 and checkpoint.keep >= 1"),
    "distributed": (["distributed.coordinator=host", "distributed.num_processes=2", "distributed.process_id=0"],
                    "distributed.coordinator: 'host' must be HOST:PORT"),
    "remat": (["remat.every_k=0"], "remat.every_k: must be >= 1, got 0"),
    "offload": (["offload.params=host", "remat.preset=none"], "offload.params=host: needs a remat preset other "
                                                              "than none"),
    "kernels": (["kernels.attn_block_q=24"], "kernels.attn_block_q: 24 must be a power of two >= 16"),
    "target": (["target.headroom=1.5"], "target.headroom: must be in [0, 1), got 1.5"),
    "out_dir": (["out_dir=''"], "out_dir: empty; name the folder for the run's outputs"),
}
BAD_CROSS = {
    "_features_rules": (["lora.rank=-1"], "lora.rank: must be >= 0 (0: full fine-tune), got -1"),
    "_seq_len_fits_model": (["train.seq_len=4096"], "train.seq_len: 4096 exceeds model.max_seq_len=2048"),
    "_remat_groups_divide_layers": (["remat.granularity=every_k", "remat.every_k=3"],
                                    "remat.every_k: 3 does not divide model.n_layers=4"),
    "_batch_fits_fixed_mesh": (["parallel.fsdp=8", "train.global_batch=24"],
                               "train.global_batch: 24 is not a multiple of micro_batch 2 x data ways 8 = 16"),
    "_attention_kernel_takes_the_model": (["model.preset=tiny-gpt-oss", "kernels.attention=cudnn"],
                                          "kernels.attention: cudnn has no attention sinks"),
}


# One bad override per feature of the registry: its rules run at load (the loader's _features_rules).
BAD_FEATURE = {
    "moe": (["parallel.ep=0"], "parallel.ep: must be a positive size (no -1 fill), got 0"),
    "lora": (["lora.rank=4", "lora.alpha=0"], "lora.alpha: must be a finite number > 0, got 0.0"),
    "update_in_backward": (["optimizer.update_in_backward=true"],
                           "optimizer.update_in_backward: needs remat.preset=full or offload_layer_inputs"),
    "pipeline": (["parallel.pp=2", "parallel.pp_layers=3,3"], "parallel.pp_layers: [3, 3] must be 2"),
    "preference": (["train.objective=dpo"], "train.objective: dpo trains on preference pairs; set "
                                            "data.format=preference"),
    "rl": (["train.objective=grpo"], "rl.prompts: train.objective=grpo needs a jsonl file of prompts"),
}


@pytest.mark.parametrize("name", sorted(BAD_FEATURE))
def test_each_features_rules_fail_at_load(name):
    from jaxmem import registry

    assert set(BAD_FEATURE) == {feature.name for feature in registry.FEATURES}
    overrides, fragment = BAD_FEATURE[name]
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_every_validator_has_a_case():
    from jaxmem import loader

    assert list(BAD_SECTION) == list(loader.SECTION_VALIDATORS)
    assert set(BAD_CROSS) == {rule.__name__ for rule in loader.CROSS_CHECKS}


@pytest.mark.parametrize("rule", [*sorted(BAD_SECTION), *sorted(BAD_CROSS)])
def test_each_validator_and_cross_check_fails_at_load(rule):
    overrides, fragment = {**BAD_SECTION, **BAD_CROSS}[rule]
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_load_config_runs_every_validator_once_in_order(monkeypatch):
    from jaxmem import loader

    ran = []
    sections, cross = list(loader.SECTION_VALIDATORS), [rule.__name__ for rule in loader.CROSS_CHECKS]
    for name in sections:
        monkeypatch.setitem(loader.SECTION_VALIDATORS, name, lambda cfg, name=name: ran.append(name))
    monkeypatch.setattr(loader, "CROSS_CHECKS", tuple((lambda cfg, name=name: ran.append(name)) for name in cross))
    load_config("configs/tiny.yaml")
    assert ran == sections + cross


def test_offload_and_kernel_errors_come_from_load_not_build(monkeypatch):
    import jaxmem.core.program

    def no_build(*args, **kwargs):
        raise AssertionError("build_program must not be reached")

    monkeypatch.setattr(jaxmem.core.program, "build_program", no_build)
    for overrides, fragment in (BAD_SECTION["offload"], BAD_SECTION["kernels"],
                                (["offload.params=host", "remat.preset=full", "remat.granularity=segments"],
                                 "needs remat.granularity=layer"),
                                (["offload.params=host", "remat.preset=full", "train.grad_accum=2"],
                                 "needs train.grad_accum=1, got 2")):
        with pytest.raises(ConfigError) as e:
            load_config("configs/tiny.yaml", overrides)
        assert fragment in str(e.value)


def test_grad_accum_derived_from_the_devices_is_checked_by_build_program():
    from jaxmem.registry import build_program

    # tiny.yaml fills fsdp (-1): the data ways, hence grad_accum = 32 / (2 x devices) (2 on 8 devices), are known
    # only with devices
    cfg = load_config("configs/tiny.yaml", ["offload.params=host", "remat.preset=full", "train.global_batch=32"])
    accum = 32 // (2 * jax.device_count())
    with pytest.raises(ConfigError, match=rf"offload\.params=host: needs train\.grad_accum=1, got {accum}\b"):
        build_program(cfg)


def _jaxmem_modules_after_import(module: str) -> list[str]:
    import subprocess
    import sys

    code = (f"import sys, {module}; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('jaxmem.'))))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_imports_go_one_way():
    """The schema imports no other jaxmem module; the modules the validators import (presets, remat,
    kernels, targets, offload) never import the loader back (no config <-> presets/remat circle)."""
    assert _jaxmem_modules_after_import("jaxmem.config.schema") == ["jaxmem.config", "jaxmem.config.schema",
                                                                    "jaxmem.version"]
    below = _jaxmem_modules_after_import("jaxmem.loader")
    assert "jaxmem.core.remat" in below and "jaxmem.model.presets" in below  # jaxmem.config: the lazy facade


def test_config_load_config_is_the_validating_loader():
    import jaxmem
    from jaxmem import loader

    assert jaxmem.load_config is loader.load_config and jaxmem.loader.from_dict is loader.from_dict
    cfg = load_config("configs/tiny.yaml")
    assert loader.from_dict(to_dict(cfg)) == cfg


@pytest.mark.parametrize("override, fragment", [
    (["data.kind=bin", "data.path=/no/such/file.bin"], "data.path: file /no/such/file.bin not found"),
    (["data.tokenizer=/no/such/tokenizer.json"], "data.tokenizer: file /no/such/tokenizer.json not found"),
    (["data.kind=jsonl", "data.path=/no/chats.jsonl", "data.tokenizer=/no/tok.json"], "data.path: file /no/chats"),
    (["data.kind=text", "data.path=configs"], "data.path: configs is not a file"),
])
def test_data_files_are_checked_when_a_run_reads_them_not_at_load(override, fragment):
    from jaxmem.io.data import make_source

    cfg = load_config("configs/tiny.yaml", override)  # plans, explain and sweep never need the files
    with pytest.raises(ConfigError) as e:
        make_source(cfg)
    assert fragment in str(e.value) and "\n" not in str(e.value)
