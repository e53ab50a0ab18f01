"""LoRA / QLoRA on a mixture of experts (tiny-moe, fp32 compute, one device): per-expert adapters' gradients
equal autodiff of the merged model W_e + s A_e B_e, an nf4 expert base runs like its dequantized weights and is
stored as nf4, QLoRA trains, PEFT files name each expert's pair and round trip, and merge-lora's merged model
gives transformers' logits."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from safetensors import safe_open

from hf_parity import hf_logits, jax_logits

from jaxmem.lora.plugin import adapter_state
from jaxmem.loader import load_config
from jaxmem.config.schema import ConfigError
from jaxmem.core.program import loss_sum_fn, stage_fn
from jaxmem.registry import build_program
from jaxmem.io.hf import save_hf
from jaxmem.lora import load_peft, merge, resolve_targets, save_peft, target_weights
from jaxmem.lora.adapters import adapter_axes, hf_target_names
from jaxmem.lora.export import merged_params
from jaxmem.lora.frozen import layer_shapes, unstore
from jaxmem.core.quant import quantized_bytes

RANK = 4
EXPERTS = ("expert_gate", "expert_up", "expert_down")


def _program(*overrides):
    cfg = load_config("configs/tiny-moe.yaml", ["parallel.fsdp=1", "train.micro_batch=2", "train.seq_len=16",
                                                 f"lora.rank={RANK}", "lora.alpha=8", *overrides])
    return build_program(cfg, devices=jax.devices()[:1])


def _batch(prog, seed=0):
    return np.random.RandomState(seed).randint(0, prog.cfg.model.vocab_size, prog.batch_shape).astype(np.int32)


def _random_adapters(prog, seed=1):
    """The program's fresh adapters with B random too (init gives B = 0)."""
    adapters = jax.device_get(adapter_state(prog)["params"])
    keys = iter(jax.random.split(jax.random.key(seed), len(adapters["layers"])))
    return {"layers": {p: {"a": ab["a"], "b": 0.05 * jax.random.normal(next(keys), ab["b"].shape)}
                       for p, ab in adapters["layers"].items()}}


def _dequantized(prog, base):
    """The model's params with every frozen linear dequantized (fp32) from the stored base."""
    setup, shapes = prog.layout.part("lora"), layer_shapes(prog.cfg, prog.layout.part("lora"))
    layers = dict(base["layers"])
    for name in setup.frozen:
        layers[name] = jax.vmap(lambda s, name=name: unstore(setup, s, shapes[name], jnp.float32))(layers[name])
    return dict(base, layers=layers)


def _reference_run(prog, params, tokens):
    """The plain model (no LoRA hooks) on `params`: (hidden before the final norm, router losses, logits)."""
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: _plain_model(prog)))[0], params)
    h, router = model.run_layers(model.embed_tokens(tokens), router_losses=True)
    logits = jnp.einsum("BTD,DV->BTV", model.final_hidden(h), model.lm_head_weight())
    return h, router, logits


def _plain_model(prog):
    from jaxmem.model import init_model

    return init_model(prog.cfg.model)


def _total(loss_sum, router):
    return loss_sum + 0.3 * router["moe_aux_loss"] + 0.2 * router["moe_z_loss"]


def test_targets_shapes_and_axes():
    prog = _program()
    cfg = prog.cfg.model
    assert prog.layout.part("lora").targets == ("wq", "wk", "wv", "wo", *EXPERTS)  # all-linear: the experts, no router
    assert prog.layout.part("lora").frozen == prog.layout.part("lora").targets
    assert resolve_targets("gate_proj,down_proj", model=cfg) == ("expert_gate", "expert_down")
    weights = target_weights(cfg)
    e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_d_ff
    assert weights["expert_down"].layer_shape == (e, f, d)
    params = prog.abstract_state["params"]["layers"]
    assert params["expert_gate"]["a"].shape == (cfg.n_layers, e, d, RANK)
    assert params["expert_gate"]["b"].shape == (cfg.n_layers, e, RANK, f)
    assert params["expert_down"]["a"].shape == (cfg.n_layers, e, f, RANK)
    assert adapter_axes(EXPERTS)["layers"]["expert_up"] == {"a": ("layers", "experts", "embed", None),
                                                            "b": ("layers", "experts", None, "mlp")}
    assert "router" not in prog.abstract_state["params"]["layers"]
    assert prog.abstract_state["base"]["layers"]["router"].dtype == jnp.float32  # frozen, unquantized
    with pytest.raises(ConfigError, match=r"lora.targets: 'gate' is not a target"):
        load_config("configs/tiny-moe.yaml", ["lora.rank=4", "lora.targets=q_proj,gate"])


@pytest.mark.slow
def test_expert_adapter_gradients_equal_the_merged_reference():
    """fp32 compute, bf16 base: d(loss + router losses)/d(A, B) through the grouped ragged_dots equals autodiff
    of the plain model on W + s A B (W: the stored base, dequantized)."""
    prog = _program()
    base = jax.device_get(prog.init_state()["base"])
    adapters = _random_adapters(prog)
    tokens = _batch(prog)[0]
    inputs, labels = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    run = loss_sum_fn(prog)

    def lora_loss(ad):
        (loss_sum, _), router = run(ad, inputs, labels, base=base, router_losses=True)
        return _total(loss_sum, router)

    def merged_loss(ad):
        params = merge(_dequantized(prog, base), ad, prog.layout.part("lora").scale)
        _, router, logits = _reference_run(prog, params, inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        loss_sum = -jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1))
        return _total(loss_sum, router)

    got_loss, got = jax.jit(jax.value_and_grad(lora_loss))(adapters)
    want_loss, want = jax.jit(jax.value_and_grad(merged_loss))(adapters)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for name in ("wq", "wo", *EXPERTS):
        for part in ("a", "b"):
            g, w = np.asarray(got["layers"][name][part]), np.asarray(want["layers"][name][part])
            assert np.abs(w).max() > 0, (name, part)
            np.testing.assert_allclose(g, w, atol=2e-5 * np.abs(w).max(), rtol=1e-3, err_msg=f"{name}.{part}")
    # every expert that got tokens has a non-zero gradient of its own adapter
    per_expert = np.abs(np.asarray(got["layers"]["expert_gate"]["b"])).sum(axis=(2, 3))
    assert (per_expert > 0).sum() >= per_expert.size // 2


@pytest.fixture(scope="module")
def qlora():
    prog = _program("lora.base_dtype=nf4")
    return prog, prog.init_state()


@pytest.mark.slow
def test_nf4_expert_base_is_stored_nf4_and_runs_as_its_dequantized_weights(qlora):
    prog, state = qlora
    cfg = prog.cfg.model
    stored = state["base"]["layers"]["expert_gate"]
    assert {k: v.dtype for k, v in stored.items()} == {"codes": jnp.uint8, "absmax": jnp.float32}
    shape = (cfg.n_layers, cfg.n_experts, cfg.d_model, cfg.expert_d_ff)
    n_bytes = sum(v.nbytes for v in stored.values())
    assert n_bytes == quantized_bytes(shape, "nf4", batch_dims=1) == int(np.prod(shape)) * 9 // 16
    assert n_bytes < 0.15 * 4 * np.prod(shape)  # 4.5 bits per weight against fp32's 32
    base = jax.device_get(state["base"])
    adapters = _random_adapters(prog, seed=4)
    tokens = jnp.asarray(_batch(prog)[0][:, :-1])
    hidden = jax.jit(lambda ad: stage_fn(prog, last=False)(ad, tokens, base=base))(adapters)
    params = merge(_dequantized(prog, base), adapters, prog.layout.part("lora").scale)
    want, _, _ = jax.jit(lambda p: _reference_run(prog, p, tokens))(params)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(want), atol=2e-5 * float(jnp.abs(want).max()))


@pytest.mark.slow
def test_qlora_moe_trains(qlora):
    """nf4 experts, adapters everywhere: the loss on a repeated batch falls; the base never changes."""
    prog, state = qlora
    before = jax.device_get(state["base"]["layers"]["expert_up"]["codes"])
    step = prog.jit_step()
    batch = prog.shard_batch(_batch(prog, seed=2))
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    assert float(metrics["moe_aux_loss"]) > 0
    np.testing.assert_array_equal(jax.device_get(state["base"]["layers"]["expert_up"]["codes"]), before)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_peft_names_each_expert_and_round_trips(tmp_path, family):
    prog = _program()
    cfg = prog.cfg.model
    if family == "mixtral":  # Mistral attention, renormalized top-k: the Mixtral family holds it
        cfg = dataclasses.replace(cfg, qk_norm=False, router_norm_topk=True)
    adapters = _random_adapters(dataclasses.replace(prog, cfg=dataclasses.replace(prog.cfg, model=cfg)))
    save_peft(adapters, cfg, tmp_path, rank=RANK, alpha=8, targets=prog.layout.part("lora").targets)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    mlp = ["gate_proj", "up_proj", "down_proj"] if family == "qwen3_moe" else ["w1", "w3", "w2"]
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", *mlp]
    assert hf_target_names(EXPERTS, cfg) == mlp
    module = ("mlp.experts.{e}.gate_proj" if family == "qwen3_moe" else "block_sparse_moe.experts.{e}.w1")
    with safe_open(str(tmp_path / "adapter_model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        last = f"base_model.model.model.layers.3.{module.format(e=7)}"
        a_last, b_last = f.get_tensor(last + ".lora_A.weight"), f.get_tensor(last + ".lora_B.weight")
    assert len(names) == 2 * cfg.n_layers * (4 + 3 * cfg.n_experts)
    np.testing.assert_array_equal(a_last, np.asarray(adapters["layers"]["expert_gate"]["a"][3, 7]).T)  # [r, D]
    np.testing.assert_array_equal(b_last, np.asarray(adapters["layers"]["expert_gate"]["b"][3, 7]).T)  # [F, r]
    loaded, settings = load_peft(tmp_path, cfg)
    assert settings["targets"] == prog.layout.part("lora").targets
    for name, ab in adapters["layers"].items():
        for part in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(loaded["layers"][name][part]), np.asarray(ab[part]))
    deeper = dataclasses.replace(cfg, n_experts=9)
    with pytest.raises(ConfigError, match=r"experts.8.*missing"):
        load_peft(tmp_path, deeper)


@pytest.mark.slow
def test_merge_lora_export_matches_transformers(tmp_path):
    """A few LoRA steps on tiny-moe, merged as merge-lora does, saved as a Hugging Face folder: transformers'
    logits equal jaxmem's merged model, whose hidden states equal the unmerged LoRA forward's (fp32)."""
    prog = _program("lora.base_dtype=int8", "optimizer.lr=0.02")
    state = prog.init_state()
    step = prog.jit_step()
    for i in range(3):
        state, _ = step(state, prog.shard_batch(_batch(prog, seed=i)))
    assert float(jnp.abs(state["params"]["layers"]["expert_down"]["b"]).max()) > 0
    params = merged_params(prog, state)
    model = nnx.merge(nnx.split(nnx.eval_shape(lambda: _plain_model(prog)))[0], params)
    save_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    tokens = _batch(prog, seed=9)[0][:, :12]
    ours = jax_logits(model, tokens)
    np.testing.assert_allclose(ours, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)
    base, adapters = jax.device_get(state["base"]), jax.device_get(state["params"])
    unmerged = jax.jit(lambda ad: stage_fn(prog, last=False)(ad, jnp.asarray(tokens), base=base))(adapters)
    want = jax.jit(lambda t: model.run_layers(model.embed_tokens(t)))(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(unmerged), np.asarray(want), atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("base_dtype", ["int8", "nf4"])
def test_streamed_expert_base_equals_the_base_built_from_whole_params(tmp_path, base_dtype):
    """checkpoint.init_from a Hugging Face Qwen3-MoE folder: each layer's experts read one HF tensor per expert,
    quantized on the host (int8 per expert and output channel, nf4 over the layer's [E, D, F]) and written into
    their fsdp-sharded slots, bit for bit the base frozen.make_base builds from the whole params."""
    from jaxmem.io.hf import load_hf
    from jaxmem.lora.frozen import make_base
    from jaxmem.lora.load_base import stream_base
    from jaxmem.model import init_model

    cfg = load_config("configs/tiny-moe.yaml", [f"lora.rank={RANK}", f"lora.base_dtype={base_dtype}",
                                                "train.seq_len=16"])
    save_hf(init_model(cfg.model, seed=7), tmp_path, dtype="bfloat16", max_shard_bytes=300_000)
    prog = build_program(cfg, devices=jax.devices())
    streamed = stream_base(prog, tmp_path)
    params = jax.device_get(nnx.to_pure_dict(nnx.split(load_hf(tmp_path, dtype="float32"))[1]))
    want = jax.jit(lambda p: make_base(prog.layout.part("lora"), cfg, p, prog.precision.param),
                   out_shardings=prog.state_shardings["base"])(params)
    assert jax.tree.structure(streamed) == jax.tree.structure(want)
    for got, expected in zip(jax.tree.leaves(streamed), jax.tree.leaves(want)):
        assert got.dtype == expected.dtype and got.sharding == expected.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert streamed["layers"]["expert_down"]["q" if base_dtype == "int8" else "codes"].dtype in (jnp.int8, jnp.uint8)


@pytest.mark.slow
def test_expert_adapters_on_the_fsdp_mesh_train_like_one_device():
    """Adapters sharded like the experts' weights (fsdp8: their embed dim; "experts" maps to no axis under the fsdp
    rules), nf4 base split per device, lora.dropout on the expert rows: the one-device losses and router losses."""
    def losses(overrides, devices):
        cfg = load_config("configs/tiny-moe.yaml", [f"lora.rank={RANK}", "lora.base_dtype=nf4", "lora.dropout=0.1",
                                                    "train.seq_len=16", "optimizer.lr=0.02", *overrides])
        prog = build_program(cfg, devices=devices)
        state, step = prog.init_state(), prog.jit_step()
        out = []
        for i in range(3):
            state, m = step(state, prog.shard_batch(_batch(prog, seed=i).reshape(prog.batch_shape)))
            out.append([float(m[k]) for k in ("loss", "grad_norm", "moe_aux_loss")])
        return np.array(out), prog

    single, _ = losses(["parallel.fsdp=1", "train.micro_batch=16"], jax.devices()[:1])
    mesh, prog = losses(["parallel.fsdp=8", "train.micro_batch=2"], jax.devices())
    a_spec = tuple(prog.state_shardings["params"]["layers"]["expert_gate"]["a"].spec)
    assert a_spec[:3] == tuple(prog.layout.model_param_specs["layers"]["expert_gate"])[:3] and "fsdp" in a_spec
    np.testing.assert_allclose(mesh, single, rtol=2e-5)
    assert single[-1, 0] != single[0, 0]
