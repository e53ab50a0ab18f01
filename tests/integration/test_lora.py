"""LoRA / QLoRA in the train step: the adapted forward equals base + scale * A B merged by hand, only the adapters
train (gradients, optimizer state), the base is never written, training lowers the loss, fsdp x tp trains like
one device, and the step never holds more than about two layers of dequantized base."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.lora.adapters import merge
from jaxmem.lora.frozen import layer_shapes, unstore
from jaxmem.core.program import loss_sum_fn
from jaxmem.registry import build_program

BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "lora.rank=4", "lora.alpha=8"]


def _tokens(rows, step=0):
    return np.random.default_rng(step).integers(0, 256, (rows, 33)).astype(np.int32)


def _program(*overrides, devices=None):
    cfg = load_config("configs/tiny.yaml", BASE + list(overrides))
    return build_program(cfg, devices=devices or jax.devices()[:1])


def _random_adapters(adapters, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8", "nf4"])
def test_adapted_forward_equals_the_base_merged_by_hand(base_dtype):
    prog = _program("parallel.fsdp=1", "train.micro_batch=2", f"lora.base_dtype={base_dtype}")
    state = prog.init_state()
    adapters = _random_adapters(jax.device_get(state["params"]))
    base = jax.device_get(state["base"])
    toks = _tokens(2)
    loss_sum = jax.jit(loss_sum_fn(prog))
    got, n = loss_sum(adapters, toks[:, :-1], toks[:, 1:], base=base)
    # reference: dequantize every frozen linear, merge W + scale * A B, run the plain model, optax-free CE
    # (jitted as one program: eager, each of its small ops would be a compile of its own)
    setup, shapes = prog.layout.part("lora"), layer_shapes(prog.cfg, prog.layout.part("lora"))

    @jax.jit
    def reference(base, adapters):
        params = dict(base, layers=dict(base["layers"]))
        for name in setup.frozen:
            per_layer = [unstore(setup, jax.tree.map(lambda x: x[i], base["layers"][name]), shapes[name],
                                 jnp.float32) for i in range(prog.cfg.model.n_layers)]
            params["layers"][name] = jnp.stack(per_layer)
        logits = nnx.merge(prog.graphdef, merge(params, adapters, setup.scale))(toks[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1).sum()

    want = reference(base, adapters)
    assert int(n) == toks[:, 1:].size
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    # the adapters change the loss: the test sees them
    plain, _ = loss_sum(jax.tree.map(jnp.zeros_like, adapters), toks[:, :-1], toks[:, 1:], base=base)
    assert abs(float(plain) - float(got)) > 1e-3


@pytest.mark.slow
def test_only_the_adapters_train_and_the_base_is_never_written():
    prog = _program("parallel.fsdp=1", "train.micro_batch=8", "lora.base_dtype=nf4",
                    "precision.param_dtype=bfloat16", "precision.master_weights=true")
    state = prog.init_state()
    base_before = jax.device_get(state["base"])
    params_before = jax.device_get(state["params"])
    step = prog.jit_step()
    losses = []
    for i in range(25):  # synthetic data the model can learn
        from jaxmem.io.data import SyntheticSource

        toks = SyntheticSource(256, 0).samples(np.arange(i * 8, i * 8 + 8), 33)
        state, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 0.25, losses
    # the trainable tree, its master copy and the optimizer state cover the adapters and nothing else
    adapter_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params_before)}
    assert adapter_paths == {jax.tree_util.keystr(p) for p, _ in
                             jax.tree_util.tree_leaves_with_path(state["master"])}
    assert all(k.endswith(("['a']", "['b']")) for k in adapter_paths)
    mu = state["opt"]["layers"][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(params_before["layers"])
    assert jax.tree.leaves(state["opt"]["rest"][0].mu) == []  # nothing outside the layers is trainable
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["base"]), base_before)
    changed = jax.tree.map(lambda a, b: bool(np.any(a != b)), jax.device_get(state["params"]), params_before)
    assert all(jax.tree.leaves(changed))


@pytest.mark.slow
def test_fsdp_by_tp_trains_like_one_device():
    """An nf4 base with double quantization split over fsdp 4 x tp 2: the one-device losses and adapters. An
    int8 base on the same mesh gives the one-device loss in test_dropout_masks_do_not_depend_on_the_mesh (the
    adapters' update does not depend on how the base is stored)."""
    base = ["lora.base_dtype=nf4", "lora.double_quant=true"]

    def run(overrides, devices):
        # a large Adam eps makes the update ~linear in the gradient, so params compare gradients
        prog = _program(*overrides, *base, "optimizer.eps=1e-1", "optimizer.lr=1e-1", devices=devices)
        state, step = prog.init_state(), prog.jit_step()
        losses = []
        for i in range(3):
            state, m = step(state, prog.shard_batch(_tokens(8, i).reshape(prog.batch_shape)))
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state["params"])

    ref_losses, ref_params = run(["parallel.fsdp=1", "train.micro_batch=8"], jax.devices()[:1])
    losses, params = run(["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp", "train.micro_batch=2"],
                         jax.devices())
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/tiny-gpt-oss.yaml"])
def test_a_quantized_base_trains_under_sequence_tiles_like_untiled(config):
    """remat.seq_tile with an nf4 base (its integer codes cross into the tiles as arguments; they once stayed
    tracers of the enclosing trace and could not be lowered) on gpt-oss: dense attention projections and a
    mixture of experts whose tiles route their own tokens: the untiled step's losses and adapters. A dense MLP's
    codes cross into the tiles the same way as the attention's; a dense model's tiles against the untiled step
    are test_sequence_parallel.py's test_sequence_tiling_matches_untiled."""
    def run(*overrides):
        # a large Adam eps makes the update ~linear in the gradient, so the adapters compare gradients
        cfg = load_config(config, BASE + ["lora.base_dtype=nf4", "parallel.fsdp=1", "train.micro_batch=4",
                                          "optimizer.eps=1e-1", "optimizer.lr=1e-1", *overrides])
        prog = build_program(cfg, devices=jax.devices()[:1])
        state, step, losses = prog.init_state(), prog.jit_step(), []
        for i in range(3):
            state, m = step(state, prog.shard_batch(_tokens(4, i).reshape(prog.batch_shape)))
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state["params"])

    ref_losses, ref_params = run()
    losses, params = run("remat.seq_tile=8")
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params, ref_params)


def _temp_bytes(n_layers: int) -> tuple[int, int]:
    prog = _program("parallel.fsdp=1", "train.micro_batch=1", "lora.base_dtype=nf4", "model.d_model=256",
                    "model.d_ff=2048", f"model.n_layers={n_layers}", "model.n_heads=4", "model.head_dim=64",
                    "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "remat.preset=full")
    m = prog.cfg.model
    layer_bf16 = 2 * (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * m.d_model
                      + 3 * m.d_model * m.d_ff)
    return prog.lower().compile().memory_analysis().temp_size_in_bytes, layer_bf16


@pytest.mark.slow
def test_dequantized_base_is_rebuilt_a_layer_at_a_time():
    """Measured on CPU (XLA's buffer assignment): four more nf4 layers add far less than one bf16 layer to the
    step's temporaries (a dequantized model would add four), and the temporaries stay within about two bf16
    layers plus activations."""
    temp4, layer = _temp_bytes(4)
    temp8, _ = _temp_bytes(8)
    assert temp8 - temp4 < 0.5 * layer, (temp4, temp8, layer)
    assert temp8 < 4 * layer, (temp8, layer)


@pytest.mark.parametrize("overrides,fragment", [
    (["lora.targets=q_proj,x_proj"], "lora.targets: 'x_proj' is not a target"),
    (["lora.rank=-1"], "lora.rank: must be >= 0"),
    (["lora.dropout=-0.1"], "lora.dropout: must be in [0, 1), got -0.1"),
    (["lora.dropout=1.0"], "lora.dropout: must be in [0, 1), got 1.0"),
    (["lora.dropout=0.1", "remat.seq_tile=8"], "lora.dropout: > 0 does not combine with remat.seq_tile"),
    (["lora.base_dtype=int4"], "lora.base_dtype: 'int4' is not allowed"),
    (["optimizer.update_in_backward=true", "remat.preset=full"], "LoRA does not combine"),
])
def test_bad_lora_settings_are_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", BASE + overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def _lora_run_overrides(out_dir, *extra):
    return BASE + ["train.steps=6", "train.log_every=1", "checkpoint.every=3", f"out_dir={out_dir}",
                   "train.progress=false", "lora.base_dtype=nf4", *extra, "parallel.fsdp=-1"]


def _lora_run_cfg(out_dir, *extra):
    return load_config("configs/tiny.yaml", _lora_run_overrides(out_dir, *extra))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """One 6-step nf4 LoRA run on 8 devices (checkpoints at steps 3 and 6), read by the log, merge and resume
    tests: (its output directory, its summary, what it printed on stderr). Tests that write into it copy it."""
    import contextlib
    import io

    from jaxmem.train import run

    out_dir, err = tmp_path_factory.mktemp("lora_run"), io.StringIO()
    with contextlib.redirect_stderr(err):
        summary = run(_lora_run_cfg(out_dir))
    return out_dir, summary, err.getvalue()


@pytest.mark.slow
def test_a_lora_run_logs_its_parameter_counts_and_sweeps_rank_and_base_dtype(tmp_path, lora_run):
    from jaxmem.cli import sweep

    err = lora_run[2]  # what the run printed on stderr
    assert "trainable parameters (LoRA rank 4 adapters)" in err and "frozen (base stored as nf4)" in err
    rows = sweep.run_sweep("configs/tiny.yaml", {"lora.rank": ["4", "16"], "lora.base_dtype": ["bfloat16", "nf4"]},
                           BASE[:-2], {}, tmp_path, tmp_path / "cache", workers=0, compile=False)
    by_point = {r["point"]: r for r in rows}
    small = by_point["lora.rank=4 lora.base_dtype=nf4"]["analytic_device_bytes"]
    assert small < by_point["lora.rank=4 lora.base_dtype=bfloat16"]["analytic_device_bytes"]
    assert small < by_point["lora.rank=16 lora.base_dtype=nf4"]["analytic_device_bytes"]


@pytest.mark.slow
def test_merge_lora_writes_a_checkpoint_with_the_trained_adapters_folded_in(tmp_path, lora_run):
    from jaxmem import cli
    from jaxmem.io.hf import load_hf
    from jaxmem.lora.peft_format import load_peft

    overrides = _lora_run_overrides(lora_run[0])
    out, peft_dir = tmp_path / "merged", tmp_path / "peft"
    assert cli.main(["merge-lora", "configs/tiny.yaml", *overrides, "--out", str(out), "--peft", str(peft_dir)]) == 0
    prog = _program(*overrides[:-1], "parallel.fsdp=1", "train.micro_batch=2")
    from jaxmem.core.checkpoint import Checkpoints, restore_run

    ckpts = Checkpoints.for_run(prog.cfg)
    state, _ = restore_run(prog, ckpts)  # the adapters, and the base rebuilt from the seed
    ckpts.close()
    toks = _tokens(2)
    want, _ = jax.jit(loss_sum_fn(prog))(state["params"], toks[:, :-1], toks[:, 1:], base=state["base"])
    merged = load_hf(out)  # the merged checkpoint, read back as a plain model
    logits = merged(toks[:, :-1])
    got = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), toks[:, 1:, None], -1).sum()
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    adapters, settings = load_peft(peft_dir, prog.cfg.model)
    assert settings["rank"] == 4 and settings["alpha"] == 8
    jax.tree.map(np.testing.assert_array_equal, adapters, jax.device_get(state["params"]))


def test_lora_checkpoints_hold_the_adapters_only_and_resume_exactly(tmp_path, lora_run):
    import shutil

    from jaxmem.core.checkpoint import _saved_shapes
    from jaxmem.train import run

    shutil.copytree(lora_run[0] / "checkpoints", tmp_path / "checkpoints")
    cfg, straight = _lora_run_cfg(tmp_path), lora_run[1]
    saved = _saved_shapes(tmp_path / "checkpoints" / "3" / "state")
    assert saved and not any("base" in k for k in saved)  # the frozen base is rebuilt, never saved
    assert any("params" in k for k in saved) and any("opt" in k for k in saved)
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    resumed = run(cfg)
    assert resumed["start_step"] == 3
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"][3:]]
    # adapters trained on one base do not resume on another
    with pytest.raises(ConfigError, match="these adapters belong to the base"):
        shutil.rmtree(tmp_path / "checkpoints" / "6")
        run(_lora_run_cfg(tmp_path, "lora.base_dtype=int8"))


@pytest.mark.slow
def test_lora_starts_from_init_from_params(tmp_path):
    import orbax.checkpoint as ocp

    from jaxmem.core.checkpoint import init_from
    from jaxmem.config.schema import to_dict
    from jaxmem.model import init_model

    model = _lora_run_cfg(tmp_path / "run").model
    params = nnx.to_pure_dict(nnx.split(init_model(model, seed=7))[1])
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp_path / "hf" / "params").absolute(), params)
    import json

    (tmp_path / "hf" / "model.json").write_text(json.dumps(to_dict(_lora_run_cfg(tmp_path / "run"))["model"]))
    cfg = _lora_run_cfg(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'hf'}")  # a model that exists
    prog = build_program(cfg)
    state = init_from(prog, tmp_path / "hf")
    np.testing.assert_array_equal(np.asarray(state["base"]["embed"]), np.asarray(params["embed"]))
    rebuilt = jax.device_get(prog.frozen_base())  # what a resume rebuilds: the same base
    jax.tree.map(np.testing.assert_array_equal, rebuilt, jax.device_get(state["base"]))


# ---------------------------------------------------------------- lora.dropout (jaxmem.lora.dropout)

# the derivation jaxmem.lora.dropout documents, written out: key(seed) -> 0x10AD -> step -> micro -> layer -> target
TARGET_ORDER = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
LOW_RANK = {"wq": ("BTD,Dr->BTr", "BTr,rNH->BTNH"), "wk": ("BTD,Dr->BTr", "BTr,rKH->BTKH"),
            "wv": ("BTD,Dr->BTr", "BTr,rKH->BTKH"), "wo": ("BTNH,NHr->BTr", "BTr,rD->BTD"),
            "w_gate": ("BTD,Dr->BTr", "BTr,rF->BTF"), "w_up": ("BTD,Dr->BTr", "BTr,rF->BTF"),
            "w_down": ("BTF,Fr->BTr", "BTr,rD->BTD")}


def _ref_key(seed, step, micro, layer, name):
    key = jax.random.key(seed)
    for i in (0x10AD, step, micro, layer, TARGET_ORDER.index(name)):
        key = jax.random.fold_in(key, i)
    return key


class _RefWeight:
    def __init__(self, name, w):
        self.name, self.w = name, w

    def __getitem__(self, index):
        return self


def _reference_loss(prog, adapters, base, toks, p, step, micro):
    """Layer by layer, unrolled: x W + scale * (drop(x) A) B with the documented keys, then the CE sum."""
    from jaxmem.model import ForwardContext
    from jaxmem.model.rope import inverse_frequencies

    cfg, setup = prog.cfg, prog.layout.part("lora")
    shapes = layer_shapes(cfg, setup)
    cd = prog.precision.compute
    model = nnx.merge(prog.graphdef, dict(base, layers={k: v for k, v in base["layers"].items()
                                                       if k not in setup.frozen} | {
        k: jnp.zeros((cfg.model.n_layers,)) for k in setup.frozen}))
    graphdef, stacked = nnx.split(model.layers)
    x, labels = toks[:, :-1], toks[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
    inv_freq = inverse_frequencies(cfg.model.head_dim, cfg.model.rope_theta, cfg.model.rope_scaling)
    h = model.embed_tokens(x, ForwardContext(compute_dtype=cd))
    for layer in range(cfg.model.n_layers):
        def project(spec, xin, w, dtype, layer=layer):
            if not isinstance(w, _RefWeight):
                return jnp.einsum(spec, xin, w.astype(dtype))
            if w.name not in setup.targets:
                return jnp.einsum(spec, xin, w.w.astype(dtype))
            keep = jax.random.bernoulli(_ref_key(cfg.train.seed, step, micro, layer, w.name), 1 - p, xin.shape)
            dropped = jnp.where(keep, xin / (1 - p), 0)
            first, second = LOW_RANK[w.name]
            ab = adapters["layers"][w.name]
            low = jnp.einsum(second, jnp.einsum(first, dropped, ab["a"][layer]), ab["b"][layer])
            return (jnp.einsum(spec, xin, w.w.astype(dtype)) + setup.scale * low).astype(dtype)

        state = jax.tree.map(lambda v: v[layer], nnx.to_pure_dict(stacked))
        for name in setup.frozen:
            w = unstore(setup, jax.tree.map(lambda v: v[layer], base["layers"][name]), shapes[name], jnp.float32)
            state[name] = _RefWeight(name, w)
        block = nnx.merge(graphdef, state)
        ctx = ForwardContext(compute_dtype=cd, project=project)
        h = block.attention_part(h, positions, None, inv_freq, ctx)
        h = block.mlp_part(h, ctx)
    h = model.final_hidden(h, ForwardContext(compute_dtype=cd))
    logits = jnp.einsum("BTD,DV->BTV", h, model.lm_head_weight().astype(cd))
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1).sum()


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["nf4"])
def test_dropout_matches_an_unrolled_reference_with_the_same_masks(base_dtype):
    """Loss and adapter gradients with lora.dropout equal the unrolled reference's with the documented keys. The
    masks fall on the adapters' input whatever the base's storage; on a bf16 base (the default) the jitted
    step's loss is test_the_step_draws_its_masks_from_step_and_micro_batch's."""
    from jaxmem.lora.dropout import step_key

    p = 0.3
    prog = _program("parallel.fsdp=1", "train.micro_batch=2", f"lora.base_dtype={base_dtype}",
                    f"lora.dropout={p}", "remat.preset=full")
    state = prog.init_state()
    adapters = _random_adapters(jax.device_get(state["params"]))
    base = jax.device_get(state["base"])
    toks = _tokens(2)
    key = step_key(prog.cfg.train.seed, 5, 1)

    def ours(ad):
        return loss_sum_fn(prog)(ad, toks[:, :-1], toks[:, 1:], base=base, dropout_key=key)[0]

    got, got_grads = jax.jit(jax.value_and_grad(ours))(adapters)
    want, want_grads = jax.value_and_grad(lambda ad: _reference_loss(prog, ad, base, toks, p, 5, 1))(adapters)
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-5), got_grads, want_grads)
    # the masks matter: another micro-batch index, or no dropout, gives another loss
    other = _reference_loss(prog, adapters, base, toks, p, 5, 2)
    plain, _ = jax.jit(loss_sum_fn(prog))(adapters, toks[:, :-1], toks[:, 1:], base=base)
    assert abs(float(other) - float(got)) > 1e-3 and abs(float(plain) - float(got)) > 1e-3


DROPOUT_P = 0.3


@pytest.fixture(scope="module")
def dropout_steps():
    """{p: (program, its step compiled once)} for lora.dropout 0 and DROPOUT_P, grad_accum 2 on one device: the
    step tests below share these two compiles, and the lowered text shows whether masks are drawn."""
    out = {}
    for p in (0.0, DROPOUT_P):
        prog = _program("parallel.fsdp=1", "train.micro_batch=2", "train.grad_accum=2", f"lora.dropout={p}")
        lowered = prog.lower()
        out[p] = (prog, lowered.compile(), lowered.as_text())
    return out


@pytest.mark.slow
def test_the_step_draws_its_masks_from_step_and_micro_batch(dropout_steps):
    """The jitted step (grad_accum=2) reports the loss of the reference with keys (seed, step, micro 0 / 1)."""
    p = DROPOUT_P
    prog, step, _ = dropout_steps[p]
    state = prog.init_state()
    state["params"] = _random_adapters(state["params"])
    adapters, base = jax.device_get(state["params"]), jax.device_get(state["base"])
    state["step"] = jnp.int32(7)
    toks = _tokens(4, 3)
    _, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
    want = sum(float(_reference_loss(prog, adapters, base, toks[2 * i:2 * i + 2], p, 7, i)) for i in range(2))
    np.testing.assert_allclose(float(m["loss"]), want / (4 * 32), rtol=2e-5)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_a_fraction_p_and_scales_the_rest(p):
    from jaxmem.lora.dropout import AdaptedWeight, FrozenWeight, project

    x = jnp.ones((8, 1024, 32), jnp.float32)  # 262,144 inputs: the fraction is within ~0.5% of p
    eye = jnp.eye(32)  # A = B = I, W = 0, scale 1: the projection returns drop(x) itself
    out = np.asarray(project("BTD,DF->BTF", x, AdaptedWeight(
        FrozenWeight(jnp.zeros((32, 32)), (32, 32), "float32"), eye, eye, jax.random.key(3), 1.0, p), jnp.float32))
    dropped = np.mean(out == 0)
    assert abs(dropped - p) < 0.005, dropped
    np.testing.assert_allclose(out[out != 0], 1 / (1 - p), rtol=1e-6)


def _one_step(prog_and_step, state, toks):
    prog, step = prog_and_step[:2]
    state = jax.tree.map(jnp.copy, state)  # the step donates its input
    new, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
    return float(m["loss"]), jax.device_get(new["params"])


def test_dropout_is_deterministic_per_step_and_differs_between_steps(dropout_steps):
    toks = _tokens(4)
    for p, differs in ((DROPOUT_P, True), (0.0, False)):
        prog = dropout_steps[p][0]
        state = prog.init_state()
        state["params"] = _random_adapters(state["params"])
        loss, params = _one_step(dropout_steps[p], state, toks)
        again, params_again = _one_step(dropout_steps[p], state, toks)
        assert loss == again
        jax.tree.map(np.testing.assert_array_equal, params, params_again)
        later, params_later = _one_step(dropout_steps[p], dict(state, step=jnp.int32(1)), toks)  # only the key
        assert (later != loss) == differs
        assert any(jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), params, params_later))) == differs


def test_dropout_zero_keeps_the_merged_step_and_eval_ignores_dropout(dropout_steps):
    from jaxmem.train.evaluate import eval_step

    (plain, _, hlo), (dropped, _, dropped_hlo) = dropout_steps[0.0], dropout_steps[DROPOUT_P]
    assert "rng_bit_generator" not in hlo and "threefry" not in hlo  # no mask is drawn at dropout 0
    assert "threefry" in dropped_hlo or "rng_bit_generator" in dropped_hlo
    state = plain.init_state()
    state["params"] = _random_adapters(state["params"])
    batch = plain.shard_batch(_tokens(4).reshape(plain.batch_shape))
    want = jax.device_get(eval_step(plain)(state["params"], state["base"], batch))
    got = jax.device_get(eval_step(dropped)(state["params"], state["base"], batch))
    assert got[0] == want[0] and got[1] == want[1]  # bit for bit: evaluation never drops
    assert _one_step(dropout_steps[0.0], state, _tokens(4))[0] != _one_step(dropout_steps[DROPOUT_P], state,
                                                                              _tokens(4))[0]


@pytest.mark.slow
def test_lora_dropout_resumes_exactly(tmp_path):
    import shutil

    from jaxmem.train import run

    cfg = _lora_run_cfg(tmp_path, "lora.dropout=0.2", "train.grad_accum=2")
    straight = run(cfg)
    shutil.rmtree(tmp_path / "checkpoints" / "6")
    resumed = run(cfg)
    assert resumed["start_step"] == 3
    assert [r["loss"] for r in resumed["records"]] == [r["loss"] for r in straight["records"][3:]]


def test_dropout_masks_do_not_depend_on_the_mesh():
    from jaxmem.lora.dropout import step_key

    toks = _tokens(8)
    losses = []
    for overrides, n in ((["parallel.fsdp=1", "train.micro_batch=8"], 1),
                         (["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp", "train.micro_batch=2"], 8)):
        prog = _program(*overrides, "lora.dropout=0.3", "lora.base_dtype=int8", devices=jax.devices()[:n])
        state = prog.init_state()
        adapters = _random_adapters(jax.device_get(state["params"]))
        batch = prog.shard_batch(toks.reshape(prog.batch_shape))["tokens"][0]
        loss_at = jax.jit(lambda a, base, t, step: loss_sum_fn(prog)(  # the step traced: one compile per mesh
            a, t[:, :-1], t[:, 1:], base=base, dropout_key=step_key(0, step, 0))[0])
        for step in (3, 4):
            losses.append(float(loss_at(adapters, state["base"], batch, step)))
    np.testing.assert_allclose(losses[0::2], losses[0], rtol=1e-6)  # step 3 on every mesh: the same masks
    np.testing.assert_allclose(losses[1::2], losses[1], rtol=1e-6)
    assert abs(losses[0] - losses[1]) > 100 * 1e-6 * abs(losses[0])  # another step's masks: another loss
