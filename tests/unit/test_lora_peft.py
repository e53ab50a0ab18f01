"""LoRA adapters vs Hugging Face PEFT: merged logits match PeftModel, the merged export loads in transformers,
save_peft / load_peft round trip, one-line errors for bad inputs."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from jaxmem.io.hf import load_hf, save_hf
from jaxmem.lora import (TARGETS, adapter_axes, init_adapters, load_peft, merge, resolve_targets, save_peft, scale,
                         target_weights)
from jaxmem.model.transformer import abstract_model
from jaxmem.config.schema import ConfigError

HF_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=128, initializer_range=0.1)
RANK, ALPHA = 4, 8.0
ALL = tuple(TARGETS.values())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF checkpoint directory, jaxmem model loaded from it)."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
    hf.save_pretrained(directory, safe_serialization=True)
    return directory, load_hf(directory)


def _hf_base(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _random_adapters(cfg, targets=ALL, rank=RANK, seed=1):
    """Non-zero A and B for every target (init_adapters gives B = 0)."""
    adapters = init_adapters(cfg, targets, rank, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 100), len(targets)))
    for ab in adapters["layers"].values():
        ab["b"] = 0.05 * jax.random.normal(next(keys), ab["b"].shape)
    return adapters


def _tokens(vocab):
    return np.random.RandomState(0).randint(0, vocab, (2, 12)).astype(np.int32)


def _logits_with(model, params, tokens):
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, params)
    return np.asarray(nnx.merge(graphdef, state)(jnp.asarray(tokens)))


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _params(model):
    return nnx.to_pure_dict(nnx.split(model)[1])


@pytest.mark.parametrize("rslora", [False, True])
def test_merged_logits_match_peft_and_merged_export(base, tmp_path, rslora):
    directory, model = base
    adapters = _random_adapters(model.cfg)
    save_peft(adapters, model.cfg, tmp_path / "adapter", rank=RANK, alpha=ALPHA, rslora=rslora, dropout=0.05,
              targets=ALL, base_model=str(directory))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["use_rslora"] is rslora and config["r"] == RANK
    assert config["target_modules"] == list(TARGETS)
    peft_model = peft.PeftModel.from_pretrained(_hf_base(directory), tmp_path / "adapter").eval()
    tokens = _tokens(model.cfg.vocab_size)
    reference = _torch_logits(peft_model, tokens)
    base_logits = _logits_with(model, _params(model), tokens)
    assert np.abs(base_logits - reference).max() > 1e-2  # the adapters change the model

    merged = merge(_params(model), adapters, scale(ALPHA, RANK, rslora))
    ours = _logits_with(model, merged, tokens)
    assert np.abs(ours - reference).max() < 1e-4, np.abs(ours - reference).max()

    # merged export: merge + save_hf is a plain HF checkpoint with the adapters folded in
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, merged)
    save_hf(nnx.merge(graphdef, state), tmp_path / "merged")
    exported = _torch_logits(_hf_base(tmp_path / "merged"), tokens)
    assert np.abs(exported - reference).max() < 1e-4, np.abs(exported - reference).max()


def test_save_load_round_trip(base, tmp_path):
    _, model = base
    targets = resolve_targets(["q_proj", "o_proj", "down_proj"])
    adapters = _random_adapters(model.cfg, targets, rank=3)
    save_peft(adapters, model.cfg, tmp_path, rank=3, alpha=6, rslora=True, dropout=0.1, targets=targets,
              base_model="tiny")
    loaded, settings = load_peft(tmp_path, model.cfg)
    assert settings == {"rank": 3, "alpha": 6, "rslora": True, "dropout": 0.1, "targets": ("wq", "wo", "w_down"),
                        "base_model": "tiny", "scale": scale(6, 3, True)}
    assert jax.tree.structure(loaded) == jax.tree.structure(adapters)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(adapters)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # bf16 adapters keep their dtype through the files
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), adapters)
    save_peft(bf16, model.cfg, tmp_path / "bf16", rank=3, alpha=6, targets=targets)
    loaded, _ = load_peft(tmp_path / "bf16", model.cfg)
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(bf16)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_shapes_axes_and_init(base):
    cfg = base[1].cfg
    adapters = init_adapters(cfg, ALL, RANK, jax.random.key(0), jnp.bfloat16)
    axes = adapter_axes(ALL)
    abstract = nnx.to_pure_dict(nnx.split(abstract_model(cfg))[1])
    layer_axes = {p: v.out_sharding for p, v in nnx.split(abstract_model(cfg))[1]["layers"].items()}
    for param, w in target_weights(cfg).items():
        a, b = adapters["layers"][param]["a"], adapters["layers"][param]["b"]
        assert a.shape == (cfg.n_layers, *w.in_shape, RANK) and b.shape == (cfg.n_layers, RANK, *w.out_shape)
        assert a.dtype == b.dtype == jnp.bfloat16 and not np.any(np.asarray(b, np.float32))
        assert abstract["layers"][param].shape == (cfg.n_layers, *w.in_shape, *w.out_shape)
        base_axes = tuple(layer_axes[param])  # ("layers", *in_axes, *out_axes) from the model's Block
        n_in = len(w.in_shape)
        assert axes["layers"][param]["a"] == (*base_axes[:1 + n_in], None)
        assert axes["layers"][param]["b"] == (base_axes[0], None, *base_axes[1 + n_in:])
    assert axes["layers"]["wq"] == {"a": ("layers", "embed", None), "b": ("layers", None, "heads", "head_dim")}
    # B = 0: merging changes nothing; one layer's slice merges like the stack
    params = _params(base[1])
    merged = merge(params, adapters, 2.0)
    for param in ALL:
        np.testing.assert_array_equal(np.asarray(merged["layers"][param]), np.asarray(params["layers"][param]))
    random = _random_adapters(cfg)
    stacked = merge(params, random, 2.0)
    layer1 = merge({"layers": {p: v[1] for p, v in params["layers"].items()}},
                   jax.tree.map(lambda x: x[1], random), 2.0)
    for param in ALL:
        np.testing.assert_allclose(np.asarray(layer1["layers"][param]), np.asarray(stacked["layers"][param][1]),
                                   atol=1e-6)
    assert scale(16, 4) == 4.0 and scale(16, 4, rslora=True) == 8.0


def _one_line_error(fn, *needles):
    with pytest.raises(ConfigError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


def test_bad_inputs(base, tmp_path):
    _, model = base
    cfg = model.cfg
    _one_line_error(lambda: resolve_targets(["q_proj", "qkv_proj"]), "lora.targets", "'qkv_proj'", "all-linear")
    assert resolve_targets("all-linear") == ALL
    adapters = _random_adapters(cfg)
    save_peft(adapters, cfg, tmp_path / "ok", rank=RANK, alpha=ALPHA, targets=ALL)

    bigger = dataclasses.replace(cfg, d_model=96)
    _one_line_error(lambda: load_peft(tmp_path / "ok", bigger), "adapter_model.safetensors",
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "[4, 64]", "[4, 96]")
    deeper = dataclasses.replace(cfg, n_layers=3)
    _one_line_error(lambda: load_peft(tmp_path / "ok", deeper), "layers.2.self_attn.q_proj.lora_A.weight", "missing")
    _one_line_error(lambda: load_peft(tmp_path / "nowhere", cfg), "adapter_config.json", "not found")
    _one_line_error(lambda: save_peft(adapters, bigger, tmp_path / "x", rank=RANK, alpha=ALPHA),
                    "adapters.layers.wq")

    config_file = tmp_path / "ok" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    for change, needles in [({"peft_type": "IA3"}, ("peft_type", "'IA3'", "LORA")),
                            ({"target_modules": ["q_proj", "lm_head"]}, ("target_modules", "'lm_head'")),
                            ({"target_modules": ".*proj"}, ("target_modules",)),
                            ({"use_dora": True}, ("use_dora",)),
                            ({"r": 0}, ("r is 0",))]:
        config_file.write_text(json.dumps({**config, **change}))
        _one_line_error(lambda: load_peft(tmp_path / "ok", cfg), "adapter_config.json", *needles)
    config_file.write_text(json.dumps(config))
    (tmp_path / "ok" / "adapter_model.safetensors").write_bytes(b"garbage")
    _one_line_error(lambda: load_peft(tmp_path / "ok", cfg), "adapter_model.safetensors")
