"""The library surface (jaxmem.api, docs/library.md): own loops built from it train like `jaxmem train`."""
import importlib.util
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmem
from jaxmem import api
from jaxmem.loader import load_config
from jaxmem.model import init_model
from jaxmem.train import initial_state, run

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
# seq 32, 2 micro-batches a step: the own loop's gradient accumulation comes from the config
OVERRIDES = ["train.seq_len=32", "train.grad_accum=2", "train.progress=false", "train.log_every=1"]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def prog():
    return api.build_program(load_config(TINY, OVERRIDES))


@pytest.mark.slow
def test_own_loop_matches_jaxmem_train(tmp_path):
    common = [*OVERRIDES, "train.steps=5", "checkpoint.every=2"]
    own = _script("train_own_loop").main([TINY, f"out_dir={tmp_path / 'own'}", *common])
    summary = run(load_config(TINY, [f"out_dir={tmp_path / 'ref'}", "checkpoint.enabled=false", *common]))
    assert [r["step"] for r in summary["records"]] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(own, [r["loss"] for r in summary["records"]], rtol=1e-5)
    cfg = load_config(TINY, [f"out_dir={tmp_path / 'own'}", *common])
    ckpts = api.Checkpoints.for_run(cfg)
    assert ckpts.all_steps() == [4, 5]  # every 2 steps and the last, keep=2 (tiny.yaml)
    prog = api.build_program(cfg)
    _, start, position, resumed = initial_state(prog, ckpts)  # what `jaxmem train` resumes from
    assert (start, resumed, position) == (5, 5, 5 * prog.grad_accum * prog.rows)
    ckpts.close()
    assert _script("train_own_loop").main([TINY, f"out_dir={tmp_path / 'own'}", *common]) == []  # resumes at 5


@pytest.mark.slow
def test_own_optimizer_and_numpy_batches_train(capsys):
    losses = _script("train_own_optimizer").main([TINY, *OVERRIDES, "train.steps=12"])
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 1.0, losses
    assert "step 12  loss" in capsys.readouterr().out


def test_place_params_takes_a_module_its_state_or_a_dict(prog):
    model = init_model(prog.cfg.model, seed=prog.cfg.train.seed)
    state = nnx.split(model)[1]
    pure = nnx.to_pure_dict(state)
    want = jax.device_get(pure)
    shardings = prog.state_shardings["params"]
    for given in (model, state, pure, jax.device_get(pure)):  # the last: numpy arrays
        placed = api.place_params(prog, given)
        assert jax.tree.structure(placed) == jax.tree.structure(shardings)
        for x, s, w in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings), jax.tree.leaves(want)):
            assert x.sharding == s
            np.testing.assert_array_equal(np.asarray(x), w)
    bf16 = api.place_params(prog, jax.tree.map(lambda x: x.astype(jnp.bfloat16), want))  # cast to the program's
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.float32)}
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(bf16), jax.tree.leaves(shardings)))
    bad = dict(pure, final_norm=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="final_norm has shape"):
        api.place_params(prog, bad)
    with pytest.raises(ValueError, match="not a parameter"):
        api.place_params(prog, dict(pure, extra=np.ones(3)))


def test_loss_fn_equals_the_train_steps_loss(prog):
    state = api.train_state(prog)
    batch = next(api.batches(prog.cfg, prog))
    assert batch["tokens"].shape == prog.batch_shape and prog.grad_accum == 2
    loss = jax.jit(api.loss_fn(prog))
    step_loss, n_valid = loss(state["params"], batch["tokens"])  # [A, B, T+1]: all micro-batches
    tokens = api.place_tokens(prog, np.asarray(batch["tokens"])[0])  # the first micro-batch, [B, T+1]
    assert tokens.sharding.spec == jax.sharding.PartitionSpec(prog.batch_sharding.spec[1], None)
    first, _ = loss(state["params"], tokens)
    _, metrics = api.train_step(prog)(state, batch)  # donates state
    np.testing.assert_allclose(float(step_loss), float(metrics["loss"]), rtol=1e-6)
    assert float(n_valid) == float(metrics["tokens"]) == np.prod(prog.batch_shape[:2]) * prog.cfg.train.seq_len
    assert abs(float(first) - float(step_loss)) < 0.5  # one micro-batch's mean is near the step's


def test_the_doc_quotes_the_example_scripts_exactly():
    doc = (REPO / "docs" / "library.md").read_text()
    quoted = dict(re.findall(r"<!-- (scripts/[\w.]+\.py) -->\n```python\n(.*?)```\n", doc, re.S))
    assert set(quoted) == {"scripts/train_own_loop.py", "scripts/train_own_optimizer.py"}
    for path, code in quoted.items():
        assert code == (REPO / path).read_text(), f"docs/library.md quotes an old {path}; paste it again"


def test_the_api_is_exported_lazily_from_jaxmem():
    for name in api.__all__:
        assert getattr(jaxmem, name) is getattr(api, name)
    assert jaxmem.optimizer(load_config(TINY, OVERRIDES)).init is not None
    with pytest.raises(AttributeError):
        jaxmem.no_such_thing  # noqa: B018
