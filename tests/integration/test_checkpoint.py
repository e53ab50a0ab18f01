"""Checkpoints: round trip, keep-last-K, finalized steps only, reshard restore, init_from."""
import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from jaxmem.core.checkpoint import Checkpoints, init_from, math_hash, run_meta
from jaxmem.config import ConfigError, to_dict
from jaxmem.loader import load_config
from jaxmem.io.data import batches
from jaxmem.kernels.cross_entropy.reference import cross_entropy_from_logits
from jaxmem.registry import build_program
from jaxmem.train import initial_state, resume_schedule, run

BASE = ["train.seq_len=32", "train.micro_batch=2", "train.progress=false", "train.log_every=1",
        "optimizer.decay_steps=10"]

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(TINY, [f"out_dir={tmp_path}", *BASE, *overrides])


def _adam(opt_state) -> optax.ScaleByAdamState:
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    return next(x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x))


def _leaves_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_keep_and_only_finalized(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.keep=2")
    prog = build_program(cfg)
    state = prog.init_state()
    ckpts = Checkpoints.for_run(cfg)
    for step in (1, 2, 3):
        state["step"] = jnp.int32(step)
        ckpts.save(step, state, run_meta(cfg, step, step * 16, 16))
    ckpts.wait()
    assert ckpts.all_steps() == [2, 3]  # keep=2
    # a step whose write never finished (orbax's temporary name) does not count
    (ckpts.directory / "9.orbax-checkpoint-tmp-1700000000").mkdir()
    assert ckpts.latest_step() == 3
    restored, meta = ckpts.restore(prog.abstract_state)
    assert meta == run_meta(cfg, 3, 48, 16)
    _leaves_equal(restored, state)
    spec = _adam(restored["opt"]["layers"]).mu["w_up"].sharding.spec  # opt: {"rest", "layers"} (jaxmem.optim.layerwise)
    assert spec == _adam(prog.state_shardings["opt"]["layers"]).mu["w_up"].spec
    ckpts.close()


def test_math_hash_ignores_mesh_and_bookkeeping_only(tmp_path):
    cfg = _cfg(tmp_path)
    same = _cfg(tmp_path / "other", "parallel.fsdp=4", "parallel.tp=2", "train.log_every=3",
                "train.micro_batch=4", "train.steps=99")  # decay_steps is fixed, so steps do not matter
    assert math_hash(cfg) == math_hash(same)
    assert math_hash(cfg) != math_hash(_cfg(tmp_path, "optimizer.lr=1e-3"))
    assert math_hash(cfg) != math_hash(_cfg(tmp_path, "train.seed=1"))


def test_extending_a_run_keeps_its_math_hash_with_the_saved_schedule(tmp_path, capsys):
    short = _cfg(tmp_path, "optimizer.decay_steps=0", "train.steps=4", "checkpoint.async_save=false")
    longer = dataclasses.replace(short, train=dataclasses.replace(short.train, steps=8))
    meta = run_meta(short, 4, 64, 16)
    assert (meta["decay_steps"], meta["warmup_steps"]) == (4, 3)  # tiny's warmup 5, cut to fit the decay
    assert math_hash(longer) != math_hash(short)  # decay_steps=0 re-read as train.steps: another schedule
    prog = build_program(short)
    state = prog.init_state()
    ckpts = Checkpoints.for_run(short)
    ckpts.save(4, state, meta)
    ckpts.wait()
    assert ckpts.meta() == meta
    kept = resume_schedule(longer, ckpts)
    assert kept.optimizer.decay_steps == 4 and math_hash(kept) == math_hash(short)
    assert "set optimizer.decay_steps=8 to decay over train.steps" in capsys.readouterr().err
    explicit = dataclasses.replace(longer, optimizer=dataclasses.replace(longer.optimizer, decay_steps=6))
    assert resume_schedule(explicit, ckpts) is explicit  # the user's value wins
    initial_state(build_program(explicit), ckpts)
    assert "set optimizer.decay_steps=4 to keep the saved schedule" in capsys.readouterr().err
    ckpts.close()
    # saved before the schedule was recorded: unchanged, but the note names the value that keeps it
    old = Checkpoints(tmp_path / "old", async_save=False)
    old.save(4, state, {k: v for k, v in meta.items() if k not in ("decay_steps", "warmup_steps")})
    old.wait()
    assert resume_schedule(longer, old) is longer
    initial_state(build_program(longer), old)
    assert "set optimizer.decay_steps=4 to keep the saved schedule" in capsys.readouterr().err
    old.close()


@pytest.mark.slow
def test_restore_onto_a_different_mesh(tmp_path):
    saved_cfg = _cfg(tmp_path, "train.steps=3", "checkpoint.every=2")  # fsdp=8
    straight = run(saved_cfg)["records"]
    ckpts = Checkpoints.for_run(saved_cfg)
    assert ckpts.all_steps() == [2, 3]
    # the same global batch of 16 rows on fsdp=4 x tp=2: micro_batch 4 per data way
    tp_cfg = _cfg(tmp_path, "train.steps=3", "checkpoint.every=2", "parallel.fsdp=4", "parallel.tp=2",
                  "parallel.rules=fsdp_tp", "train.micro_batch=4")
    tp_prog = build_program(tp_cfg)
    on_tp, meta = ckpts.restore(tp_prog.abstract_state, step=2)
    on_fsdp, _ = ckpts.restore(build_program(saved_cfg).abstract_state, step=2)
    _leaves_equal(on_tp, on_fsdp)
    wq = on_tp["params"]["layers"]["wq"]
    assert wq.sharding.spec == tp_prog.state_shardings["params"]["layers"]["wq"].spec
    assert "tp" in str(wq.sharding.spec) and wq.addressable_shards[0].data.shape != wq.shape
    assert meta["step"] == 2 and meta["data_position"] == 32
    # resuming on the new mesh replays step 3 like the uninterrupted fsdp=8 run
    ckpts.close()
    shutil.rmtree(tmp_path / "checkpoints" / "3")
    resumed = run(tp_cfg)
    assert resumed["resumed_from"] == 2 and [r["step"] for r in resumed["records"]] == [3]
    np.testing.assert_allclose(resumed["records"][0]["loss"], straight[2]["loss"], rtol=2e-5)


def _write_params_checkpoint(directory, cfg, seed):
    """What `jaxmem import-hf` writes: <dir>/params (StandardCheckpointer) and <dir>/model.json."""
    donor = build_program(dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision,
                                                                                param_dtype="float32")))
    params = donor.init_state(seed=seed)["params"]
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((directory / "params").absolute(), params)
    (directory / "model.json").write_text(json.dumps(to_dict(cfg)["model"]))
    return jax.tree.map(np.asarray, params)


MIXED = ["precision.param_dtype=bfloat16", "precision.master_weights=true"]


# the last: state and layers in pinned host memory, restored there and assembled a layer at a time (host_init)
HOST = ["offload.optimizer=host", "offload.params=host", "remat.preset=full"]


@pytest.mark.parametrize("precision", [[], MIXED, MIXED + HOST], ids=["fp32", "mixed", "mixed_host"])
def test_init_from_loads_params_with_fresh_optimizer_state(tmp_path, precision):
    cfg = _cfg(tmp_path / "run", *precision)
    saved = _write_params_checkpoint(tmp_path / "hf", cfg, seed=7)
    prog = build_program(cfg)
    state = init_from(prog, tmp_path / "hf")
    dtype = prog.precision.param
    _leaves_equal(state["params"], jax.tree.map(lambda x: x.astype(dtype), saved))
    if "master" in state:
        _leaves_equal(state["master"], jax.tree.map(lambda x: x.astype(dtype).astype(np.float32), saved))
    assert int(state["step"]) == 0
    adam = _adam(state["opt"]["rest"])
    assert int(adam.count) == 0 and all(not np.asarray(m).any() for m in jax.tree.leaves(adam.mu))
    layers = _adam(state["opt"]["layers"])
    assert all(not np.asarray(m).any() for m in jax.tree.leaves((layers.mu, layers.nu)))
    if "offload.params=host" in precision:
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"]["layers"])} == {"pinned_host"}


def test_training_starts_from_init_from_params(tmp_path):
    saved = _write_params_checkpoint(tmp_path / "hf", _cfg(tmp_path / "run", "train.steps=1"), seed=7)
    cfg = _cfg(tmp_path / "run", "train.steps=1", f"checkpoint.init_from={tmp_path / 'hf'}")
    first = run(cfg)["records"][0]["loss"]
    # independent reference: the loaded params' logits on step 0's batch, plain cross-entropy
    prog = build_program(cfg)
    tokens = np.asarray(next(batches(cfg, prog))["tokens"])[0]
    model = prog.model(jax.tree.map(jnp.asarray, saved))
    logits = model(jnp.asarray(tokens[:, :-1]))
    loss_sum, count = cross_entropy_from_logits(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    np.testing.assert_allclose(first, float(loss_sum / count), rtol=1e-5)


def test_init_from_with_another_model_is_a_config_error(tmp_path):
    cfg = _cfg(tmp_path / "run")
    _write_params_checkpoint(tmp_path / "hf", cfg, seed=0)
    other = _cfg(tmp_path / "run", "model.d_ff=384")
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from: .* d_ff=352 .* model\.d_ff=384"):
        init_from(build_program(other), tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from: .*model\.json not found"):
        init_from(build_program(cfg), tmp_path / "missing")


def test_init_from_refuses_another_layer_function(tmp_path):
    """Qwen3 / Gemma 3 keys change what a layer computes with the same shapes: an init_from checkpoint whose
    model.json differs in one of them is refused in one line naming the key."""
    from jaxmem.loader import load_config
    from jaxmem.io.model_match import check_model_json
    from jaxmem.config.schema import ConfigError

    cfg = load_config("configs/tiny-gemma3.yaml")
    saved = dataclasses.asdict(cfg.model)
    (tmp_path / "model.json").write_text(json.dumps(saved))
    check_model_json(tmp_path, cfg)  # the same model: accepted
    saved["sliding_window"] = cfg.model.sliding_window + 1
    (tmp_path / "model.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"^checkpoint.init_from: .* sliding_window=.*model.sliding_window="):
        check_model_json(tmp_path, cfg)
