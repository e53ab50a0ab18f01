"""gpt-oss: logits parity with transformers' GptOssForCausalLM through `jaxmem.load_hf` and back out through
`save_hf`, the published sizes of the presets, YaRN frequencies against transformers' own, the clamped SwiGLU's
backward against autodiff, MXFP4 checkpoints read as transformers dequantizes them, and the one-line refusals
(other quantized checkpoints, PEFT files for stacked experts)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from hf_parity import hf_logits, jax_logits, meta_param_count, saved_checkpoints, random_tokens

import jaxmem
from jaxmem.config import ConfigError, ModelConfig
from jaxmem.io.hf import save_hf
from jaxmem.io.hf_config import hf_config_from_model, model_config_from_hf
from jaxmem.model.gated import gated_activation, gated_reference
from jaxmem.model.presets import (PUBLISHED_ACTIVE_PARAMS_B, PUBLISHED_PARAM_COUNTS, active_param_count, param_count,
                                  resolve_model)
from jaxmem.model.rope import attention_factor, inverse_frequencies

SEQ = 20
# Odd sizes: vocab 97, hidden 72 with 6 heads of 16, 5 experts of width 40, top 2; 3 layers (local, global,
# local) with a window of 5 < SEQ; YaRN whose ramp falls inside the 8 frequencies (original context 16).
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 16, "rope_theta": 150000.0}
CONFIG = dict(hidden_size=72, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
              head_dim=16, vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.15,
              num_local_experts=5, num_experts_per_tok=2, sliding_window=5, rope_parameters=YARN)


def _hf_model(name):
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG),
                                                          attn_implementation="eager")
    with torch.no_grad():  # non-trivial norms, sinks (around 2: they take a visible share), biases and router
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) + 1.0)
            elif "sinks" in pname or "bias" in pname or "router" in pname or "experts" in pname:
                p.copy_(0.3 * torch.randn_like(p) + (2.0 if "sinks" in pname else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return saved_checkpoints(tmp_path_factory, ["gpt_oss"], _hf_model)["gpt_oss"]


def test_load_hf_matches_transformers(checkpoint):
    directory, hf_model = checkpoint
    model = jaxmem.load_hf(directory)
    cfg = model.cfg
    assert (cfg.sliding_window, cfg.global_every, cfg.n_experts, cfg.experts_per_token) == (5, 2, 5, 2)
    assert cfg.attention_sinks and cfg.attn_out_bias and cfg.moe_biases and cfg.activation == "swiglu_clamped"
    tokens = random_tokens(cfg.vocab_size)
    np.testing.assert_allclose(jax_logits(model, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


def test_sinks_and_biases_matter(checkpoint):
    """The parity above is not reached without them: zeroed sinks or expert biases move the logits."""
    directory, hf_model = checkpoint
    model = jaxmem.load_hf(directory)
    tokens = random_tokens(model.cfg.vocab_size)
    ref = jax_logits(model, tokens)
    for name in ("sinks", "bq", "bo", "router_bias", "expert_gate_bias", "expert_up_bias", "expert_down_bias"):
        changed = jaxmem.load_hf(directory)
        param = getattr(changed.layers, name)
        param[...] = jnp.zeros_like(param[...])
        assert np.abs(jax_logits(changed, tokens) - ref).max() > 1e-2, name


def test_export_reloads_in_transformers(checkpoint, tmp_path):
    directory, hf_model = checkpoint
    model = jaxmem.load_hf(directory)
    save_hf(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["GptOssForCausalLM"]
    assert written["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = random_tokens(model.cfg.vocab_size)
    np.testing.assert_array_equal(hf_logits(again, tokens), hf_logits(hf_model, tokens))  # the same tensors
    assert jaxmem.load_hf(tmp_path).cfg == model.cfg


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_presets_match_transformers_and_the_model_card(preset):
    cfg = resolve_model(ModelConfig(preset=preset), {})
    hf = hf_config_from_model(cfg, "bfloat16")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert meta_param_count(config) == param_count(cfg) == PUBLISHED_PARAM_COUNTS[preset]
    # the card's active count leaves the input embedding table out (the unembedding counts): 3.61B, 5.13B
    active = active_param_count(cfg) - cfg.vocab_size * cfg.d_model
    assert abs(active / 1e9 - PUBLISHED_ACTIVE_PARAMS_B[preset]) < 0.005
    assert model_config_from_hf(hf_config_from_model(cfg, "bfloat16")) == cfg.__class__(
        **{**cfg.__dict__, "preset": "custom"})


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim,theta,original,factor", [(64, 150000.0, 4096, 32.0), (16, 10000.0, 16, 4.0)])
def test_yarn_frequencies_match_transformers(truncate, head_dim, theta, original, factor):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate, "rope_theta": theta}
    hf = transformers.GptOssConfig(head_dim=head_dim, max_position_embeddings=original * int(factor),
                                   rope_parameters=rope)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    ours = inverse_frequencies(head_dim, theta, {k: v for k, v in rope.items() if k != "rope_theta"})
    np.testing.assert_allclose(np.asarray(ours), inv.numpy(), rtol=1e-6)
    assert attention_factor(rope) == pytest.approx(scale)
    assert not np.allclose(np.asarray(ours), np.asarray(inverse_frequencies(head_dim, theta)))  # it scales


def test_clamped_swiglu_backward_equals_autodiff():
    """The lean backward (recomputes from gate and up) against plain autodiff of the forward, with values on
    both sides of the clamps."""
    rng = np.random.default_rng(0)
    gate = jnp.asarray(rng.uniform(-10, 10, (64, 24)), jnp.float32)
    up = jnp.asarray(rng.uniform(-10, 10, (64, 24)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(64, 24)), jnp.float32)
    assert float(jnp.max(gate)) > 7 and float(jnp.min(up)) < -7
    ours = jax.vjp(lambda g, u: gated_activation("swiglu_clamped", g, u), gate, up)[1](cotangent)
    plain = jax.vjp(lambda g, u: gated_reference("swiglu_clamped", g, u), gate, up)[1](cotangent)
    for a, b in zip(ours, plain):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    torch_out = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate(
        type("E", (), {"limit": 7.0, "alpha": 1.702})(),
        torch.tensor(np.stack([np.asarray(gate), np.asarray(up)], -1).reshape(64, 48)))
    np.testing.assert_allclose(gated_reference("swiglu_clamped", gate, up), torch_out.numpy(), rtol=1e-6, atol=1e-6)


def _mxfp4_pair(rng, experts, out, inputs):
    """Random MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32] (exponents 2^-6 .. 2^-1)."""
    blocks = rng.integers(0, 256, (experts, out, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(127 - 6, 127, (experts, out, inputs // 32), dtype=np.uint8)
    return blocks, scales


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path):
    """The Hub's gpt-oss format: each layer's experts as MXFP4 blocks + scales. load_hf reads them dequantized
    (a slice at a time) to the weights transformers' own dequantizer gives, and the logits match transformers
    with those weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from jaxmem.io.hf_mxfp4 import Mxfp4Reader
    from jaxmem.io.hf_safetensors import CheckpointReader

    config = dict(CONFIG, hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4,
                  num_key_value_heads=2)  # MXFP4 groups of 32 along every input dim
    torch.manual_seed(9)
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**config),
                                                             attn_implementation="eager").eval()
    hf_model.save_pretrained(tmp_path)
    tensors, rng = load_file(str(tmp_path / "model.safetensors")), np.random.default_rng(0)
    e, d, f = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for layer, block in enumerate(hf_model.model.layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        for proj, out, inputs in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            blocks, scales = _mxfp4_pair(rng, e, out, inputs)
            del tensors[prefix + proj]
            tensors[prefix + proj + "_blocks"] = torch.from_numpy(blocks)
            tensors[prefix + proj + "_scales"] = torch.from_numpy(scales)
            with torch.no_grad():  # transformers' dequantizer: [E, in, out]
                getattr(block.mlp.experts, proj).copy_(convert_moe_packed_tensors(
                    torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32))
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))

    model = jaxmem.load_hf(tmp_path)
    gate_up = hf_model.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(np.asarray(model.layers.expert_gate[...][1]), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(model.layers.expert_up[...][1]), gate_up[..., 1::2])
    tokens = random_tokens(model.cfg.vocab_size)
    np.testing.assert_allclose(jax_logits(model, tokens), hf_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)
    # a slice across MXFP4 groups, not aligned to them, reads what the whole tensor holds there
    reader = Mxfp4Reader(CheckpointReader(tmp_path))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    whole = reader.read(name, (slice(None),) * 3)
    np.testing.assert_array_equal(reader.read(name, (slice(1, 3), slice(5, 40), slice(7, 70))),
                                  whole[1:3, 5:40, 7:70])


def test_another_quantized_checkpoint_is_refused_in_one_line(checkpoint):
    directory, _ = checkpoint
    hf = json.loads((directory / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "bitsandbytes"}
    with pytest.raises(ConfigError, match="quant_method='bitsandbytes'") as e:
        model_config_from_hf(hf, where="config.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,key", [(dict(swiglu_limit=5.0), "swiglu_limit"),
                                        (dict(attention_bias=False), "attention_bias"),
                                        (dict(rope_parameters=dict(YARN, mscale=0.7)), "mscale")])
def test_unsupported_options_are_one_line_errors(change, key):
    with pytest.raises(ConfigError, match=key) as e:
        model_config_from_hf({**json.loads(json.dumps(hf_config_from_model(
            resolve_model(ModelConfig(preset="tiny-gpt-oss"), {}), "float32"))), **change}, where="config.json")
    assert "\n" not in str(e.value)


def test_peft_files_for_stacked_experts_are_not_written_yet(tmp_path):
    from jaxmem.config.schema import NotYetSupported
    from jaxmem.lora.adapters import target_weights
    from jaxmem.lora.peft_format import save_peft

    cfg = resolve_model(ModelConfig(preset="tiny-gpt-oss"), {})
    w = target_weights(cfg)["expert_gate"]
    adapters = {"layers": {"expert_gate": {"a": np.zeros((cfg.n_layers, *w.lead_shape, w.in_features, 2)),
                                           "b": np.zeros((cfg.n_layers, *w.lead_shape, 2, w.out_features))}}}
    with pytest.raises(NotYetSupported, match="expert_gate.*stacked tensor"):
        save_peft(adapters, cfg, tmp_path, rank=2, alpha=4.0)
