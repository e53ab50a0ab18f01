"""Qwen3 dense and Gemma 3 text: logits parity with transformers through `jaxmem.load_hf` from a saved HF
folder and back out through `save_hf` (the exported folder reloaded in transformers), published sizes of the
presets, and the one-line errors of their config translation."""
import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_parity import (hf_logits as _ref_logits, jax_logits as _logits, meta_param_count, random_tokens,
                       saved_checkpoints)

import jaxmem
from jaxmem.config import ConfigError, ModelConfig
from jaxmem.io.hf import save_hf
from jaxmem.io.hf_config import hf_config_from_model, model_config_from_hf
from jaxmem.kernels import select_attention
from jaxmem.model.presets import PUBLISHED_PARAM_COUNTS, TEXT_DECODER_PARAM_COUNTS, param_count, resolve_model
from jaxmem.model.transformer import ForwardContext
from jaxmem.config.schema import KernelConfig

SEQ = 20
# Odd sizes: vocab 97 / 131, d_ff 136, hidden 72 with 6 heads of 16 (head_dim != hidden / heads).
CASES = {
    "qwen3": (transformers.Qwen3Config, dict(
        hidden_size=72, intermediate_size=136, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, vocab_size=97, max_position_embeddings=256, rope_theta=1000000.0, rms_norm_eps=1e-6,
        initializer_range=0.15)),
    # 8 layers with global every 3rd (layers 2 and 5 global, the rest local; the first global layer is not
    # the last), a window of 5 < SEQ, linear RoPE scaling on the global layers, a query scalar != head_dim.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        hidden_size=72, intermediate_size=136, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2,
        head_dim=16, vocab_size=131, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.15,
        query_pre_attn_scalar=20, sliding_window=5, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def _hf_model(name):
    config_cls, kwargs = CASES[name]
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation="eager")
    with torch.no_grad():  # non-trivial norm weights (HF inits Qwen's to 1, Gemma's to 0)
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) + (0.0 if name == "gemma3" else 1.0))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return saved_checkpoints(tmp_path_factory, CASES, _hf_model)


@pytest.mark.parametrize("name", list(CASES))
def test_load_hf_matches_transformers(checkpoints, name):
    directory, hf_model = checkpoints[name]
    model = jaxmem.load_hf(directory)
    tokens = random_tokens(model.cfg.vocab_size)
    ref = _ref_logits(hf_model, tokens)
    ours = _logits(model, tokens)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()


@pytest.mark.parametrize("name", list(CASES))
def test_export_reloads_in_transformers(checkpoints, name, tmp_path):
    directory, hf_model = checkpoints[name]
    model = jaxmem.load_hf(directory)
    save_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [hf_model.config.architectures[0]]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens = random_tokens(model.cfg.vocab_size)
    assert np.abs(_ref_logits(again, tokens) - _ref_logits(hf_model, tokens)).max() < 1e-4
    assert jaxmem.load_hf(tmp_path).cfg == model.cfg  # and the config round-trips exactly


def test_gemma3_config_mapping(checkpoints):
    cfg = jaxmem.load_hf(checkpoints["gemma3"][0]).cfg
    assert (cfg.sliding_window, cfg.global_every, cfg.rope_local_theta, cfg.rope_theta) == (5, 3, 10000.0, 1e6)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.query_pre_attn_scalar == 20 and cfg.head_dim == 16 and cfg.tie_embeddings
    assert cfg.qk_norm and cfg.post_norms and cfg.embed_scale and cfg.activation == "gelu_tanh"
    qwen = jaxmem.load_hf(checkpoints["qwen3"][0]).cfg
    assert qwen.qk_norm and not qwen.post_norms and not qwen.qkv_bias and qwen.head_dim == 16


def test_gemma3_layer_kinds_matter(checkpoints):
    """The window and the per-kind RoPE bases change the logits: a wrong layer kind cannot pass parity."""
    import dataclasses

    model = jaxmem.load_hf(checkpoints["gemma3"][0])
    tokens = random_tokens(model.cfg.vocab_size)
    base = _logits(model, tokens)
    for change in (dict(global_every=2), dict(sliding_window=0, global_every=0), dict(rope_local_theta=1e6)):
        other = nnx.merge(*_swap_cfg(model, dataclasses.replace(model.cfg, **change)))
        assert np.abs(_logits(other, tokens) - base).max() > 1e-3, change


def _swap_cfg(model, cfg):
    from jaxmem.model.transformer import abstract_model

    graphdef, _ = nnx.split(abstract_model(cfg))
    return graphdef, nnx.split(model)[1]


def test_gemma3_pallas_window_matches_xla(checkpoints):
    """The windowed Pallas kernel (interpret mode) inside the model: same logits as plain XLA attention."""
    model = jaxmem.load_hf(checkpoints["gemma3"][0])
    tokens = random_tokens(model.cfg.vocab_size, seq=40)  # > block size 16 and > 2 windows
    kernels = KernelConfig(attention="pallas", attn_block_q=16, attn_block_k=16)
    ctx = ForwardContext(attention=select_attention(kernels, "cpu"))
    np.testing.assert_allclose(_logits(model, tokens, ctx), _logits(model, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-32b", "gemma3-12b", "gemma3-27b"])
def test_presets_match_transformers_parameter_counts(preset):
    """Each preset, exported as a config.json, builds (on the meta device) a transformers model with exactly
    our parameter count, which is also the published (Qwen3) or text-decoder (Gemma 3) figure."""
    cfg = resolve_model(ModelConfig(preset=preset), {})
    hf = hf_config_from_model(cfg, "bfloat16")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert meta_param_count(config) == param_count(cfg)
    assert param_count(cfg) == {**PUBLISHED_PARAM_COUNTS, **TEXT_DECODER_PARAM_COUNTS}[preset]
    assert model_config_from_hf(hf_config_from_model(cfg, "bfloat16")) == cfg.__class__(
        **{**cfg.__dict__, "preset": "custom"})


@pytest.mark.parametrize("change,key", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(layer_types=["sliding_attention", "full_attention", "full_attention"]), "layer_types"),
])
def test_gemma3_unsupported_options_are_one_line_errors(change, key):
    hf = {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 4, **change}
    with pytest.raises(ConfigError, match=key) as e:
        model_config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_qwen3_sliding_window_refused():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "use_sliding_window": True}
    with pytest.raises(ConfigError, match="use_sliding_window"):
        model_config_from_hf(hf)


def test_export_refuses_a_family_that_lacks_the_options():
    cfg = resolve_model(ModelConfig(preset="tiny-qwen3"), {})
    with pytest.raises(ConfigError, match="LlamaForCausalLM needs model.qk_norm=False"):
        hf_config_from_model(cfg, "float32", "LlamaForCausalLM")


def test_import_hf_gemma3_snippet_trains_from_it(checkpoints, tmp_path, capsys):
    """`jaxmem import-hf` of a Gemma 3 folder: the printed config snippet loads (layer-kind keys included),
    and the orbax params equal load_hf's (norms already 1 + w)."""
    import orbax.checkpoint as ocp

    from jaxmem.cli import main as cli_main
    from jaxmem.loader import load_config

    directory, hf_model = checkpoints["gemma3"]
    out = tmp_path / "imported"
    assert cli_main(["import-hf", str(directory), str(out)]) == 0
    snippet = tmp_path / "from_hf.yaml"
    snippet.write_text(capsys.readouterr().out.split("put this in your config:\n", 1)[1])
    model = jaxmem.load_hf(directory)
    assert load_config(snippet).model == model.cfg
    restored = ocp.StandardCheckpointer().restore(out / "params")
    expected = nnx.to_pure_dict(nnx.split(model)[1])
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf_norm = hf_model.model.layers[0].input_layernorm.weight.detach().numpy()
    np.testing.assert_allclose(np.asarray(restored["layers"]["attn_norm"])[0], 1.0 + hf_norm, rtol=1e-6)
