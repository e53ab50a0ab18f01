"""HF interop: logits parity with transformers, sharded streaming load, save_hf round trip, import-hf."""
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_parity import hf_logits as _ref_logits, jax_logits as _logits

import jaxmem
from jaxmem.mesh import sharding
from jaxmem.config import ConfigError, ModelConfig, ParallelConfig
from jaxmem.loader import load_config
from jaxmem.io.hf import load_hf, save_hf
from jaxmem.cli.import_hf import main as import_hf_main
from jaxmem.io.hf_layout import read_slice, to_hf

# Odd sizes on purpose: head_dim 24 / 12, vocab 97 / 131 (prime), d_ff 136.
COMMON = dict(hidden_size=72, intermediate_size=136, num_hidden_layers=2, max_position_embeddings=256,
              initializer_range=0.15)  # larger than HF's 0.02 so attention is far from uniform
CASES = {
    "llama": (transformers.LlamaConfig, dict(COMMON, num_attention_heads=3, num_key_value_heads=3, vocab_size=97,
                                             rms_norm_eps=1e-5)),
    "llama3_tied": (transformers.LlamaConfig, dict(
        COMMON, num_attention_heads=6, num_key_value_heads=2, vocab_size=131, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=16))),
    "qwen2": (transformers.Qwen2Config, dict(COMMON, num_attention_heads=6, num_key_value_heads=2, vocab_size=131,
                                             rope_theta=1000000.0, rms_norm_eps=1e-6)),
    "mistral": (transformers.MistralConfig, dict(COMMON, num_attention_heads=6, num_key_value_heads=2,
                                                 vocab_size=97, sliding_window=64)),
}
SEQ = 20  # beyond original_max_position_embeddings=16, so the llama3 scaling matters


def _hf_model(name, **extra):
    config_cls, kwargs = CASES[name]
    torch.manual_seed(list(CASES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs, **extra),
                                                          attn_implementation="eager")
    with torch.no_grad():  # random norm weights and biases (HF inits 1 and 0), so a swapped tensor shows
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(torch.randn_like(p))
    return model.eval()


def _tokens(vocab, batch=2, seq=SEQ, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq)).astype(np.int32)


def _params(model):
    return nnx.to_pure_dict(nnx.split(model)[1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (directory, fp32 reference model). llama3_tied is stored in bf16 over several shards."""
    out = {}
    for name in CASES:
        directory = tmp_path_factory.mktemp(name)
        model = _hf_model(name)
        if name == "llama3_tied":
            model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
            model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
        else:
            model.save_pretrained(directory, safe_serialization=True)
        out[name] = (directory, model)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoints, name):
    directory, hf_model = checkpoints[name]
    model = jaxmem.load_hf(directory)  # the package-level entry point
    tokens = _tokens(model.cfg.vocab_size)
    ours, ref = _logits(model, tokens), _ref_logits(hf_model, tokens)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    assert model.cfg.preset == "custom"


def test_config_mapping(checkpoints):
    tied = load_hf(checkpoints["llama3_tied"][0]).cfg
    assert tied.tie_embeddings and tied.n_heads == 6 and tied.n_kv_heads == 2 and tied.head_dim == 12
    assert tied.rope_theta == 500000.0
    assert tied.rope_scaling == dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=16)
    assert len(list(checkpoints["llama3_tied"][0].glob("*.safetensors"))) > 1  # the multi-shard case is real
    assert load_hf(checkpoints["qwen2"][0]).cfg.qkv_bias
    assert load_hf(checkpoints["mistral"][0]).cfg.max_seq_len == 64  # capped at the sliding window


# Fields of the published config.json files (transformers 4.x style: rope_theta + rope_scaling).
LLAMA32_1B = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
              "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
              "mlp_bias": False, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
             "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
             "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.mark.parametrize("hf_config,preset", [(LLAMA32_1B, "llama3.2-1b"), (QWEN25_7B, "qwen2.5-7b")])
def test_published_configs_map_to_presets(hf_config, preset):
    from jaxmem.io.hf_config import model_config_from_hf
    from jaxmem.model.presets import PRESETS, PUBLISHED_PARAM_COUNTS, param_count

    cfg = model_config_from_hf(hf_config)
    assert dataclasses.replace(cfg, preset=preset) == ModelConfig(preset=preset, **PRESETS[preset])
    assert param_count(cfg) == PUBLISHED_PARAM_COUNTS[preset]


def test_shards_without_index_file(checkpoints, tmp_path):
    directory = tmp_path / "no_index"
    shutil.copytree(checkpoints["llama3_tied"][0], directory)
    (directory / "model.safetensors.index.json").unlink()
    with_index, without = _params(load_hf(checkpoints["llama3_tied"][0])), _params(load_hf(directory))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), with_index, without)


def test_bf16_checkpoint_values_are_exact(checkpoints):
    directory, hf_model = checkpoints["llama3_tied"]
    model = load_hf(directory, dtype="bfloat16")
    params, state = _params(model), hf_model.state_dict()
    assert params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(params["embed"], np.float32), state["model.embed_tokens.weight"].numpy())
    q1 = state["model.layers.1.self_attn.q_proj.weight"].numpy()  # [N*H, D]
    np.testing.assert_array_equal(np.asarray(params["layers"]["wq"][1], np.float32),
                                  q1.reshape(6, 12, 72).transpose(2, 0, 1))


@pytest.mark.parametrize("kind,shape", [("same", (5, 7)), ("transpose", (5, 7)), ("in_heads", (9, 6, 4)),
                                        ("out_heads", (6, 4, 9)), ("bias_heads", (6, 4))])
def test_read_slice_inverts_to_hf(kind, shape):
    ours = np.random.RandomState(1).randn(*shape).astype(np.float32)
    theirs = to_hf(kind, ours)
    rng = np.random.RandomState(2)
    for _ in range(10):
        index = []
        for size in shape:
            start = rng.randint(0, size)
            index.append(slice(start, rng.randint(start + 1, size + 1)))
        got = read_slice(kind, lambda hf_index: theirs[hf_index], tuple(index), shape)
        np.testing.assert_array_equal(got, ours[tuple(index)])


@pytest.mark.parametrize("fsdp,tp,rules", [(8, 1, "fsdp"), (4, 2, "fsdp_tp")])
def test_sharded_load(checkpoints, fsdp, tp, rules):
    directory, hf_model = checkpoints["qwen2"]
    parallel = ParallelConfig(fsdp=fsdp, tp=tp, rules=rules)
    mesh = sharding.make_mesh(parallel)
    model = load_hf(directory, mesh=mesh, parallel=parallel)
    state = nnx.split(model)[1]
    expected = sharding.param_specs(state, sharding.RULE_TABLES[rules], mesh)
    got = jax.tree.map(lambda x: x.sharding.spec, _params(model))
    assert got == expected
    wq = _params(model)["layers"]["wq"]
    want = (2, 72 // fsdp, 6 // tp, 12)  # [L, D, N, H] split over fsdp (embed) and tp (heads)
    assert {s.data.shape for s in wq.addressable_shards} == {want}
    single = _params(load_hf(directory))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), _params(model), single)
    tokens = _tokens(131)
    assert np.abs(_logits(model, tokens) - _ref_logits(hf_model, tokens)).max() < 1e-4


def test_sharded_load_reads_only_each_devices_slice(checkpoints, monkeypatch):
    from jaxmem.io.hf_safetensors import CheckpointReader

    reads = []
    original = CheckpointReader.read

    def counting_read(self, name, index):
        part = original(self, name, index)
        reads.append((name, part.size))
        return part

    monkeypatch.setattr(CheckpointReader, "read", counting_read)
    parallel = ParallelConfig(fsdp=8)
    load_hf(checkpoints["qwen2"][0], mesh=sharding.make_mesh(parallel), parallel=parallel)
    for name, full in (("model.layers.1.self_attn.q_proj.weight", 72 * 72), ("model.embed_tokens.weight", 131 * 72)):
        sizes = [n for tensor, n in reads if tensor == name]
        assert sizes == [full // 8] * 8  # eight disjoint eighths, never the whole tensor


@pytest.mark.parametrize("name,on_mesh", [("qwen2", True), ("llama3_tied", False), ("mistral", False)])
def test_save_hf_round_trip(checkpoints, tmp_path, name, on_mesh):
    directory, hf_model = checkpoints[name]
    mesh = sharding.make_mesh(ParallelConfig(fsdp=4, tp=2, rules="fsdp_tp")) if on_mesh else None
    parallel = ParallelConfig(fsdp=4, tp=2, rules="fsdp_tp") if on_mesh else None
    model = load_hf(directory, mesh=mesh, parallel=parallel)
    arch = hf_model.config.architectures[0]
    shards = save_hf(model, tmp_path, architecture=arch, max_shard_bytes=60_000)
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    original, back = hf_model.state_dict(), reloaded.state_dict()
    for key, value in original.items():
        np.testing.assert_array_equal(back[key].numpy(), value.numpy(), err_msg=key)
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    np.testing.assert_allclose(_ref_logits(reloaded, tokens), _ref_logits(hf_model, tokens), rtol=0, atol=1e-6)


def test_save_hf_single_file_bf16(checkpoints, tmp_path):
    model = load_hf(checkpoints["llama"][0])
    save_hf(model, tmp_path, dtype="bfloat16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    again = _params(load_hf(tmp_path, dtype="float32"))
    want = np.asarray(_params(model)["layers"]["w_down"]).astype(jnp.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(again["layers"]["w_down"]), want)


def test_import_hf_writes_restorable_checkpoint(checkpoints, tmp_path, capsys):
    import orbax.checkpoint as ocp

    from jaxmem.cli import main as cli_main

    directory = checkpoints["llama3_tied"][0]
    out = tmp_path / "imported"
    assert cli_main(["import-hf", str(directory), str(out), "--dtype", "bfloat16"]) == 0
    printed = capsys.readouterr().out
    assert f"init_from: {out}" in printed and "preset: custom" in printed
    model = load_hf(directory, dtype="bfloat16")
    assert json.loads((out / "model.json").read_text()) == dataclasses.asdict(model.cfg)
    snippet = tmp_path / "from_hf.yaml"  # the printed snippet is a valid config for this model
    snippet.write_text(printed.split("put this in your config:\n", 1)[1])
    cfg = load_config(snippet)
    assert cfg.model == model.cfg and cfg.checkpoint.init_from == str(out)
    assert cfg.precision.param_dtype == "bfloat16"
    restored = ocp.StandardCheckpointer().restore(out / "params")
    expected = _params(model)
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected)):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ConfigError, match="already exists"):
        import_hf_main([str(directory), str(out)])


def _broken_copy(checkpoints, tmp_path, edit):
    directory = tmp_path / "broken"
    shutil.copytree(checkpoints["llama"][0], directory)
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("edit,key", [
    (lambda c: c.update(architectures=["GPT2LMHeadModel"]), "architectures"),
    (lambda c: c.update(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
     "rope_parameters.rope_type"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "rope_parameters.original_max_position_embeddings must be a positive int"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.update(attention_bias=True), "attention_bias"),
    (lambda c: c.update(intermediate_size=140), "mlp.gate_proj.weight has shape"),
    (lambda c: c.update(num_hidden_layers=3), "tensor model.layers.2.input_layernorm.weight is missing"),
])
def test_unsupported_checkpoint_one_line_error(checkpoints, tmp_path, edit, key):
    directory = _broken_copy(checkpoints, tmp_path, edit)
    with pytest.raises(ConfigError) as info:
        load_hf(directory)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_cli_reports_unsupported_architecture(checkpoints, tmp_path, capsys):
    from jaxmem.cli import main as cli_main

    directory = _broken_copy(checkpoints, tmp_path, lambda c: c.update(architectures=["BertModel"]))
    assert cli_main(["import-hf", str(directory), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "architectures=['BertModel'] is not supported" in err
