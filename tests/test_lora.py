"""LoRA / QLoRA in the train step: the adapted forward equals base + scale * A B merged by hand, only the adapters
train (gradients, optimizer state), the base is never written, training lowers the loss, fsdp x tp trains like
one device, and the step never holds more than about two layers of dequantized base."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem.config import ConfigError, load_config
from jaxmem.lora.adapters import merge
from jaxmem.lora.frozen import layer_shapes, unstore
from jaxmem.program import build_program, loss_sum_fn

BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "lora.rank=4", "lora.alpha=8"]


def _tokens(rows, step=0):
    return np.random.default_rng(step).integers(0, 256, (rows, 33)).astype(np.int32)


def _program(*overrides, devices=None):
    cfg = load_config("configs/tiny.yaml", BASE + list(overrides))
    return build_program(cfg, devices=devices or jax.devices()[:1])


def _random_adapters(adapters, seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree.map(lambda x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), adapters)


@pytest.mark.parametrize("base_dtype", ["bfloat16", "int8", "nf4"])
def test_adapted_forward_equals_the_base_merged_by_hand(base_dtype):
    prog = _program("parallel.fsdp=1", "train.micro_batch=2", f"lora.base_dtype={base_dtype}")
    state = prog.init_state()
    adapters = _random_adapters(jax.device_get(state["params"]))
    base = jax.device_get(state["base"])
    toks = _tokens(2)
    got, n = jax.jit(loss_sum_fn(prog))(adapters, toks[:, :-1], toks[:, 1:], base=base)
    # reference: dequantize every targeted weight, merge W + scale * A B, run the plain model, optax-free CE
    setup, shapes = prog.layout.lora, layer_shapes(prog.cfg, prog.layout.lora)
    params = dict(base, layers=dict(base["layers"]))
    for name in setup.targets:
        per_layer = [unstore(setup, jax.tree.map(lambda x: x[i], base["layers"][name]), shapes[name], jnp.float32)
                     for i in range(prog.cfg.model.n_layers)]
        params["layers"][name] = jnp.stack(per_layer)
    params = merge(params, adapters, setup.scale)
    logits = nnx.merge(prog.graphdef, params)(toks[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    want = -jnp.take_along_axis(logp, toks[:, 1:, None], axis=-1).sum()
    assert int(n) == toks[:, 1:].size
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)
    # the adapters change the loss: the test sees them
    plain, _ = jax.jit(loss_sum_fn(prog))(jax.tree.map(jnp.zeros_like, adapters), toks[:, :-1], toks[:, 1:],
                                          base=base)
    assert abs(float(plain) - float(got)) > 1e-3


def test_only_the_adapters_train_and_the_base_is_never_written():
    prog = _program("parallel.fsdp=1", "train.micro_batch=8", "lora.base_dtype=nf4",
                    "precision.param_dtype=bfloat16", "precision.master_weights=true")
    state = prog.init_state()
    base_before = jax.device_get(state["base"])
    params_before = jax.device_get(state["params"])
    step = prog.jit_step()
    losses = []
    for i in range(25):  # synthetic data the model can learn
        from jaxmem.data import SyntheticSource

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


def test_fsdp_by_tp_trains_like_one_device():
    def run(overrides, devices):
        # a large Adam eps makes the update ~linear in the gradient, so params compare gradients
        prog = _program(*overrides, "lora.base_dtype=int8", "optimizer.eps=1e-1", "optimizer.lr=1e-1",
                        devices=devices)
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


def _temp_bytes(n_layers: int) -> tuple[int, int]:
    prog = _program("parallel.fsdp=1", "train.micro_batch=1", "lora.base_dtype=nf4", "model.d_model=256",
                    "model.d_ff=2048", f"model.n_layers={n_layers}", "model.n_heads=4", "model.head_dim=64",
                    "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "remat.preset=full")
    m = prog.cfg.model
    layer_bf16 = 2 * (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * m.d_model
                      + 3 * m.d_model * m.d_ff)
    return prog.lower().compile().memory_analysis().temp_size_in_bytes, layer_bf16


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
    (["lora.dropout=0.1"], "lora.dropout: 0.1 is not supported yet"),
    (["lora.base_dtype=int4"], "lora.base_dtype: 'int4' is not allowed"),
    (["optimizer.update_in_backward=true", "remat.preset=full"], "LoRA does not combine"),
])
def test_bad_lora_settings_are_refused_by_name(overrides, fragment):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", BASE + overrides)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_lora_run_logs_its_parameter_counts_and_sweeps_rank_and_base_dtype(tmp_path, capsys):
    from jaxmem import sweep
    from jaxmem.train import run

    cfg = load_config("configs/tiny.yaml", BASE + ["train.steps=2", f"out_dir={tmp_path / 'run'}",
                                                   "checkpoint.enabled=false", "train.progress=false"])
    run(cfg)
    err = capsys.readouterr().err
    assert "trainable parameters (LoRA rank 4 adapters)" in err and "frozen (base stored as bfloat16)" in err
    rows = sweep.run_sweep("configs/tiny.yaml", {"lora.rank": ["4", "16"], "lora.base_dtype": ["bfloat16", "nf4"]},
                           BASE[:-2], {}, tmp_path, tmp_path / "cache", workers=0, compile=False)
    by_point = {r["point"]: r for r in rows}
    small = by_point["lora.rank=4 lora.base_dtype=nf4"]["analytic_device_bytes"]
    assert small < by_point["lora.rank=4 lora.base_dtype=bfloat16"]["analytic_device_bytes"]
    assert small < by_point["lora.rank=16 lora.base_dtype=nf4"]["analytic_device_bytes"]


def test_merge_lora_writes_a_checkpoint_with_the_trained_adapters_folded_in(tmp_path, capsys):
    from jaxmem import cli
    from jaxmem.hf import load_hf
    from jaxmem.lora.peft_format import load_peft
    from jaxmem.train import run

    overrides = BASE + ["train.steps=3", f"out_dir={tmp_path / 'run'}", "train.progress=false", "lora.base_dtype=nf4",
                        "parallel.fsdp=-1"]
    run(load_config("configs/tiny.yaml", overrides))
    out, peft_dir = tmp_path / "merged", tmp_path / "peft"
    assert cli.main(["merge-lora", "configs/tiny.yaml", *overrides, "--out", str(out), "--peft", str(peft_dir)]) == 0
    prog = _program(*overrides[:-1], "parallel.fsdp=1", "train.micro_batch=2")
    from jaxmem.checkpoint import Checkpoints, restore_run

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


def _lora_run_cfg(tmp_path, *extra):
    return load_config("configs/tiny.yaml", BASE + ["train.steps=6", "train.log_every=1", "checkpoint.every=3",
                                                   f"out_dir={tmp_path}", "train.progress=false",
                                                   "lora.base_dtype=nf4", "parallel.fsdp=-1", *extra])


def test_lora_checkpoints_hold_the_adapters_only_and_resume_exactly(tmp_path):
    import shutil

    from jaxmem.checkpoint import _saved_shapes
    from jaxmem.train import run

    cfg = _lora_run_cfg(tmp_path)
    straight = run(cfg)
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


def test_lora_starts_from_init_from_params(tmp_path):
    import orbax.checkpoint as ocp

    from jaxmem.checkpoint import init_from
    from jaxmem.schema import to_dict
    from jaxmem.model import init_model

    cfg = _lora_run_cfg(tmp_path / "run", f"checkpoint.init_from={tmp_path / 'hf'}")
    params = nnx.to_pure_dict(nnx.split(init_model(cfg.model, seed=7))[1])
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((tmp_path / "hf" / "params").absolute(), params)
    import json

    (tmp_path / "hf" / "model.json").write_text(json.dumps(to_dict(cfg)["model"]))
    prog = build_program(cfg)
    state = init_from(prog, tmp_path / "hf")
    np.testing.assert_array_equal(np.asarray(state["base"]["embed"]), np.asarray(params["embed"]))
    rebuilt = jax.device_get(prog.frozen_base())  # what a resume rebuilds: the same base
    jax.tree.map(np.testing.assert_array_equal, rebuilt, jax.device_get(state["base"]))
