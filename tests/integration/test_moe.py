"""Mixture of experts (Qwen3-MoE, Mixtral): routing and the dropless grouped experts against a per-token numpy
reference, the router losses against numpy and transformers, logits parity with transformers through
`jaxmem.load_hf` and back out through `save_hf`, the presets' published sizes, training on the CPU mesh,
and the one-line errors of bad settings."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from hf_parity import (hf_logits as _ref_logits, jax_logits as _logits, meta_param_count, random_tokens,
                       saved_checkpoints)

import jaxmem
from jaxmem.config import ConfigError, ModelConfig
from jaxmem.loader import load_config
from jaxmem.io.hf import save_hf
from jaxmem.io.hf_config import hf_config_from_model, model_config_from_hf
from jaxmem.model.layers import Block
from jaxmem.model.moe import apply_moe, route, router_losses
from jaxmem.model.presets import (PUBLISHED_ACTIVE_PARAMS_B, PUBLISHED_PARAM_COUNTS, active_param_count,
                                  param_count, resolve_model)
from jaxmem.model.transformer import DEFAULT_CONTEXT, init_model
from jaxmem.registry import build_program

# Odd sizes: vocab 97, hidden 72 with 6 heads of 16, 5 experts of width 40 (Qwen3-MoE: d_ff 136 is the unused
# dense width), top 2 / top 3.
_SHAPE = dict(hidden_size=72, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
              vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.15)
CASES = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        _SHAPE, intermediate_size=136, moe_intermediate_size=40, num_experts=5, num_experts_per_tok=3,
        norm_topk_prob=False, rope_theta=1000000.0)),
    "qwen3_moe_norm": (transformers.Qwen3MoeConfig, dict(
        _SHAPE, intermediate_size=136, moe_intermediate_size=40, num_experts=5, num_experts_per_tok=2,
        norm_topk_prob=True)),
    "mixtral": (transformers.MixtralConfig, dict(_SHAPE, intermediate_size=40, num_local_experts=5,
                                                 num_experts_per_tok=2)),
}


def _hf_model(name):
    config_cls, kwargs = CASES[name]
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation="eager")
    with torch.no_grad():  # non-trivial norm weights; a router that does not route uniformly
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(0.5 * torch.randn_like(p) + 1.0)
            if pname.endswith("gate.weight") and p.dim() == 2:
                p.copy_(torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return saved_checkpoints(tmp_path_factory, CASES, _hf_model)


@pytest.mark.parametrize("name", list(CASES))
def test_load_hf_matches_transformers(checkpoints, name):
    directory, hf_model = checkpoints[name]
    model = jaxmem.load_hf(directory)
    assert model.cfg.n_experts == 5 and model.cfg.experts_per_token == CASES[name][1]["num_experts_per_tok"]
    tokens = random_tokens(model.cfg.vocab_size)
    ref = _ref_logits(hf_model, tokens)
    np.testing.assert_allclose(_logits(model, tokens), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_export_reloads_in_transformers(checkpoints, name, tmp_path):
    directory, hf_model = checkpoints[name]
    save_hf(jaxmem.load_hf(directory), tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf_model)
    tokens = random_tokens(hf_model.config.vocab_size)
    np.testing.assert_allclose(_ref_logits(reloaded, tokens), _ref_logits(hf_model, tokens), atol=1e-4, rtol=1e-4)


def _numpy_router_losses(layer_logits, k):
    """transformers' load_balancing_loss_func (no mask) and the z-loss, over per-layer [N, E] logits."""
    n_experts = layer_logits[0].shape[-1]
    counts, probs, z, rows = np.zeros(n_experts), np.zeros(n_experts), 0.0, 0
    for logits in layer_logits:
        logits = logits.astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, :k]
        counts += np.bincount(top.reshape(-1), minlength=n_experts)
        probs += p.sum(0)
        z += np.sum((np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)) ** 2)
        rows += logits.shape[0]
    return n_experts * np.sum(counts / rows * probs / rows), z / rows


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_router_losses_match_numpy_and_transformers(checkpoints, name):
    directory, hf_model = checkpoints[name]
    model = jaxmem.load_hf(directory)
    tokens = random_tokens(model.cfg.vocab_size)
    with torch.no_grad():
        out = hf_model(torch.tensor(tokens, dtype=torch.long), output_router_logits=True)
    layer_logits = [r.float().numpy() for r in out.router_logits]
    aux_ref, z_ref = _numpy_router_losses(layer_logits, model.cfg.experts_per_token)
    _, losses = jax.jit(lambda t: model.run_layers(model.embed_tokens(t), router_losses=True))(jnp.asarray(tokens))
    np.testing.assert_allclose(float(losses["moe_aux_loss"]), aux_ref, rtol=1e-5)
    np.testing.assert_allclose(float(out.aux_loss), aux_ref, rtol=1e-5)  # the numpy reference is transformers'
    np.testing.assert_allclose(float(losses["moe_z_loss"]), z_ref, rtol=1e-5)
    assert aux_ref > model.cfg.experts_per_token  # a skewed router: above the balanced value k


@pytest.mark.parametrize("norm", [True, False])
def test_moe_layer_matches_a_per_token_reference(norm):
    """The dropless sort / ragged_dot / combine equals, token by token, the weighted sum of its top-k experts."""
    cfg = ModelConfig(**{**resolve_model(ModelConfig(preset="tiny-moe"), {}).__dict__, "router_norm_topk": norm})
    layer = Block(cfg, jnp.float32, nnx.Rngs(params=1))
    layer.router[...] = layer.router[...] * 50  # routing far from uniform
    w = {k: np.asarray(getattr(layer, k)[...], np.float64) for k in
         ("router", "expert_gate", "expert_up", "expert_down")}
    x = np.random.RandomState(0).randn(2, 9, cfg.d_model).astype(np.float32)
    out, stats = apply_moe(layer, jnp.asarray(x), DEFAULT_CONTEXT, activation="silu", tag=lambda v, n: v)
    ref = np.zeros((18, cfg.d_model))
    for i, t in enumerate(x.reshape(18, -1).astype(np.float64)):
        logits = t @ w["router"]
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p)[:cfg.experts_per_token]
        weights = p[top] / (p[top].sum() if norm else 1.0)
        for e, wt in zip(top, weights):
            g, u = t @ w["expert_gate"][e], t @ w["expert_up"][e]
            ref[i] += wt * ((g / (1 + np.exp(-g))) * u) @ w["expert_down"][e]
    np.testing.assert_allclose(np.asarray(out).reshape(18, -1), ref, atol=2e-5, rtol=1e-4)
    assert float(stats["expert_rows"].sum()) == 18 * cfg.experts_per_token  # dropless: every assignment ran


def test_route_mixtral_softmax_of_topk_logits_equals_renormalized_probs():
    logits = np.random.RandomState(1).randn(7, 6).astype(np.float32)
    _, weights, experts = route(jnp.asarray(logits), 2, True)
    top = np.sort(logits, axis=-1)[:, ::-1][:, :2]
    mixtral = np.exp(top - top.max(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(weights), mixtral / mixtral.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(experts), np.argsort(-logits, axis=-1)[:, :2])


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_presets_match_transformers_and_published_counts(preset):
    cfg = resolve_model(ModelConfig(preset=preset), {})
    hf = hf_config_from_model(cfg, "bfloat16")
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    assert meta_param_count(config) == param_count(cfg) == PUBLISHED_PARAM_COUNTS[preset]
    assert abs(active_param_count(cfg) / 1e9 - PUBLISHED_ACTIVE_PARAMS_B[preset]) < 0.06  # cards: 3.3B, 12.9B
    assert model_config_from_hf(hf_config_from_model(cfg, "bfloat16")) == cfg.__class__(
        **{**cfg.__dict__, "preset": "custom"})


BASE = ["train.seq_len=32", "train.micro_batch=1", "optimizer.warmup_steps=0", "model.n_experts=8",
        "model.experts_per_token=2", "model.router_z_loss_coef=0.001"]


def _train(overrides, devices, rows=8, steps=4):
    cfg = load_config("configs/tiny.yaml", BASE + overrides)
    prog = build_program(cfg, devices=devices)
    state, step = prog.init_state(), prog.jit_step()
    out = []
    for _ in range(steps):
        toks = np.random.default_rng(0).integers(0, 256, size=(rows, cfg.train.seq_len + 1)).astype(np.int32)
        state, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
        out.append([float(m[k]) for k in ("loss", "moe_aux_loss", "moe_z_loss")])
    return np.array(out)


@functools.cache
def _one_device():
    """The one-device step's 4 steps on the repeated batch, shared by the mesh, router-coefficient and lever tests
    (a 2-step run is its first two rows: the same batch every step)."""
    return _train(["parallel.fsdp=1", "train.micro_batch=8"], jax.devices()[:1])


@pytest.mark.slow
def test_tiny_moe_trains_on_the_mesh_like_one_device():
    single = _one_device()
    assert single[-1, 0] < single[0, 0] - 0.5, single  # one batch, seen again: the loss falls
    assert np.all(single[:, 1] >= 2.0 - 1e-3) and np.all(single[:, 2] > 0)  # logged; balanced: k = 2
    np.testing.assert_allclose(_train(["parallel.fsdp=8"], jax.devices()), single, rtol=2e-5)
    # two micro-batches of 4 rows: the same first-step losses up to the router losses' per-micro-batch pooling
    accum = _train(["parallel.fsdp=1", "train.micro_batch=4", "train.global_batch=8"], jax.devices()[:1], steps=1)
    np.testing.assert_allclose(accum[0, 0], single[0, 0], rtol=2e-5)


@pytest.mark.slow
def test_router_loss_coefficient_reaches_the_gradient():
    off = _one_device()[:2]  # the default coefficient, 0.001: next to 10, all but off
    on = _train(["parallel.fsdp=1", "train.micro_batch=8", "model.router_aux_loss_coef=10"], jax.devices()[:1],
                steps=2)
    np.testing.assert_allclose(off[0], on[0], rtol=1e-6)  # the first step's metrics: before any update
    assert abs(on[1, 0] - off[1, 0]) > 1e-4  # the first update differs


def test_load_balancing_gradient_balances_a_skewed_router():
    """Gradient descent on the load-balancing loss alone (router weights only) lowers it towards k."""
    cfg = resolve_model(ModelConfig(preset="tiny-moe"), {})
    graphdef, state = nnx.split(Block(cfg, jnp.float32, nnx.Rngs(params=2)))
    pure = nnx.to_pure_dict(state)
    x = jnp.asarray(np.random.RandomState(0).randn(4, 16, cfg.d_model).astype(np.float32) + 1.0)
    skew = np.zeros((cfg.d_model, cfg.n_experts), np.float32)
    skew[:, :2] = 0.01  # every token's common component favours experts 0 and 1

    def aux(router):
        layer = nnx.merge(graphdef, {**pure, "router": router})
        _, stats = apply_moe(layer, x, DEFAULT_CONTEXT, activation="silu", tag=lambda v, n: v)
        return router_losses(stats, cfg.n_experts)["moe_aux_loss"]

    router = pure["router"] + skew
    first = float(aux(router))
    step = jax.jit(lambda r: r - 0.01 * jax.grad(aux)(r))
    for _ in range(10):
        router = step(router)
    assert first > cfg.experts_per_token + 1.0, first  # far above the balanced value k
    assert float(aux(router)) < cfg.experts_per_token + 0.3, (first, float(aux(router)))


@pytest.mark.parametrize("overrides,key,kind", [
    (["model.n_experts=4", "model.experts_per_token=5"], "model.experts_per_token", ConfigError),
    (["model.experts_per_token=2"], "model.experts_per_token", ConfigError),
    (["model.n_experts=4"], "model.experts_per_token", ConfigError),
    (["parallel.ep=2"], "parallel.ep", ConfigError),
    (["model.n_experts=6", "model.experts_per_token=2", "parallel.ep=4"], "model.n_experts", ConfigError),
    (["model.n_experts=4", "model.experts_per_token=2", "parallel.ep=-1"], "parallel.ep", ConfigError),
    (["model.n_experts=4", "model.experts_per_token=2", "model.moe_capacity_factor=1.5"],
     "model.moe_capacity_factor", NotImplementedError),
    (["model.n_experts=4", "model.experts_per_token=2", "parallel.ep=2", "model.moe_capacity_factor=-1"],
     "model.moe_capacity_factor", ConfigError),
    (["model.n_experts=4", "model.experts_per_token=2", "parallel.ep=2", "lora.rank=4"], "lora.rank",
     NotImplementedError),
    (["model.n_experts=4", "model.experts_per_token=2", "parallel.ep=2", "optimizer.update_in_backward=true"],
     "optimizer.update_in_backward", NotImplementedError),
    (["model.n_experts=4", "model.experts_per_token=2", "parallel.ep=2", "model.moe_capacity_factor=1.5",
      "remat.seq_tile=8"], "remat.seq_tile", NotImplementedError),
])
def test_bad_moe_settings_are_one_line_errors(overrides, key, kind):
    with pytest.raises(kind, match=key.replace(".", r"\.")) as e:
        load_config("configs/tiny.yaml", overrides)
    assert "\n" not in str(e.value) and isinstance(e.value, ConfigError)


@pytest.mark.parametrize("change,key", [
    (dict(mlp_only_layers=[0]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_unsupported_qwen3_moe_options_are_one_line_errors(change, key):
    hf = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 11, "hidden_size": 8, "intermediate_size": 8,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 4, **change}
    with pytest.raises(ConfigError, match=key) as e:
        model_config_from_hf(hf)
    assert "\n" not in str(e.value)


def test_active_parameters_count_the_routed_experts_only():
    """Against the initialized arrays: every array whole, but of the expert arrays k / n_experts."""
    cfg = resolve_model(ModelConfig(preset="tiny-moe"), {})
    pure = nnx.to_pure_dict(nnx.state(init_model(cfg)))
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    total = sum(x.size for _, x in flat)
    experts = sum(x.size for path, x in flat if "expert_" in jax.tree_util.keystr(path))
    assert param_count(cfg) == total
    assert active_param_count(cfg) == total - experts * (cfg.n_experts - cfg.experts_per_token) // cfg.n_experts
    dense = resolve_model(ModelConfig(preset="tiny"), {})
    assert active_param_count(dense) == param_count(dense)


def test_moe_checkpoint_names_are_tagged_in_the_layer():
    from jaxmem.config.names import MOE_NAMES

    model = init_model(resolve_model(ModelConfig(preset="tiny-moe"), {}))
    jaxpr = str(jax.make_jaxpr(lambda t: model(t))(np.zeros((1, 8), np.int32)))
    for name in MOE_NAMES + ("mlp_norm", "mlp_out", "layer_input"):
        assert f"name={name}" in jaxpr, name
    for name in ("mlp_gate", "mlp_up", "mlp_act"):  # the dense MLP's names are not used
        assert f"name={name}" not in jaxpr, name


@pytest.mark.slow
@pytest.mark.parametrize("overrides,mesh", [
    (["parallel.fsdp=1", "train.micro_batch=8", "remat.preset=selective", "remat.granularity=segments"], 1),
    (["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp", "train.micro_batch=2"], 8),
    (["parallel.fsdp=4", "parallel.ep=2", "train.micro_batch=1", "remat.seq_tile=8"], 8),
])
def test_moe_levers_keep_the_losses(overrides, mesh):
    """Remat (segments; sequence tiles, each routing its own tokens, with ep), fsdp x tp: the plain step's loss
    and router losses. Sequence tiles alone on one device (full remat) are test_lora.py's
    test_a_quantized_base_trains_under_sequence_tiles_like_untiled[configs/tiny-gpt-oss.yaml] (a mixture of
    experts whose tiles route their own tokens, against the untiled step)."""
    plain = _one_device()[:2]
    np.testing.assert_allclose(_train(overrides, jax.devices()[:mesh], steps=2), plain, rtol=2e-5)


def test_the_expert_backward_materializes_d_gate_and_d_up_behind_a_barrier(monkeypatch):
    """grouped_mlp's gate and up pass their gradients through an optimization barrier (so XLA writes them once in
    their dtype instead of fusing the activation's fp32 backward into the grouped matmul's row gather); the
    gradients are the same numbers without it."""
    import jax

    from jaxmem.model import moe

    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(12, 8)), jnp.float32)
    weights = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((3, 8, 5), (3, 8, 5), (3, 5, 8))]
    sizes = jnp.asarray([5, 0, 6], jnp.int32)  # one row past the groups: it comes out zero

    def loss(*w):
        out = moe.grouped_mlp(rows, sizes, *w, activation="silu", tag=lambda v, n: v,
                              matmul=lambda x, ww, g: jax.lax.ragged_dot(x, ww, g))
        return jnp.sum(out ** 2)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*weights))
    assert jaxpr.count("optimization_barrier") == 2
    with_barrier = jax.grad(loss, argnums=(0, 1, 2))(*weights)
    monkeypatch.setattr(moe, "cotangent_barrier", lambda x: x)
    assert "optimization_barrier" not in str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*weights))
    for a, b in zip(with_barrier, jax.grad(loss, argnums=(0, 1, 2))(*weights)):
        np.testing.assert_array_equal(a, b)
        assert float(jnp.abs(a).max()) > 0
