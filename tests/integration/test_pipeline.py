"""Pipeline parallelism: numerics against one device (dense and mixture of experts), checkpoints across
layouts, HF export. The schedules and partitions are tests/unit/test_pipeline_schedule.py, the per-stage
compiled plan tests/integration/test_pipeline_plan.py."""
import shutil

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.registry import build_pipeline
from jaxmem.registry import build_program

# As tests/integration/test_parallel.py: a large Adam eps makes params after a few steps compare gradients.
BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "optimizer.lr=1e-1", "optimizer.eps=1e-1",
        "checkpoint.enabled=false"]
STEPS, ROWS, ACCUM = 3, 8, 4


def _tokens(step, cfg, prog):
    toks = np.random.default_rng(step).integers(0, 256, size=(ACCUM * prog.rows, cfg.train.seq_len + 1))
    return toks.astype(np.int32).reshape(prog.batch_shape)


def _train(prog, cfg, steps=STEPS, state=None, start=0, keys=("loss", "grad_norm")):
    """Per step, the metrics named by `keys` as a tuple; and the final state."""
    state = prog.init_state() if state is None else state
    step, out = prog.jit_step(), []
    for i in range(start, start + steps):
        state, m = step(state, prog.shard_batch(_tokens(i, cfg, prog)))
        out.append(tuple(float(m[k]) for k in keys))
    return out, state


def _single(extra):
    cfg = load_config("configs/tiny.yaml", BASE + ["parallel.fsdp=1", f"train.micro_batch={ROWS}",
                                                   f"train.grad_accum={ACCUM}"] + extra)
    prog = build_program(cfg, devices=jax.devices()[:1])
    metrics, state = _train(prog, cfg)
    return metrics, jax.device_get(state)


def _pipeline(layout, extra=()):
    cfg = load_config("configs/tiny.yaml", BASE + [f"train.grad_accum={ACCUM}"] + layout + list(extra))
    return cfg, build_pipeline(cfg)


@pytest.fixture(scope="module")
def reference():
    return _single([])


LAYOUTS = {  # stage devices x micro_batch = ROWS rows per micro-batch
    "pp2_fsdp4": ["parallel.pp=2", "parallel.fsdp=4", "train.micro_batch=2"],
    "pp4_fsdp2": ["parallel.pp=4", "parallel.fsdp=2", "train.micro_batch=4"],
    "pp2_fsdp2_tp2": ["parallel.pp=2", "parallel.fsdp=2", "parallel.tp=2", "parallel.rules=fsdp_tp",
                      "train.micro_batch=4", "parallel.pp_layers=1,3"],
}


# Each layout once and each schedule on several layouts: with the mixture-of-experts cases below (pp4 gpipe,
# pp2 x ep2 1f1b) and the levers (pp2 x fsdp4, the default 1f1b), every layout meets both schedules; the
# schedules' tick order itself is tests/unit/test_pipeline_schedule.py.
@pytest.mark.slow
@pytest.mark.parametrize("name,kind", [("pp2_fsdp4", "gpipe"), ("pp4_fsdp2", "1f1b"), ("pp2_fsdp2_tp2", "gpipe")])
def test_pipeline_matches_one_device(name, kind, reference):
    cfg, pipe = _pipeline(LAYOUTS[name], [f"parallel.pp_schedule={kind}"])
    metrics, state = _train(pipe, cfg)
    want_metrics, want_state = reference
    np.testing.assert_allclose([m[0] for m in metrics], [m[0] for m in want_metrics], rtol=2e-6)
    np.testing.assert_allclose([m[1] for m in metrics], [m[1] for m in want_metrics], rtol=2e-5)
    whole = pipe.whole_state(state, want_state)
    for part in ("params", "opt"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6),
                     whole[part], want_state[part])


LEVERS = {  # tied embeddings (the last stage's copy) with Qwen2's qkv bias, bf16 + fp32 master, remat,
    # activation and optimizer offload
    "tied_qkv_bias": ["model.tie_embeddings=true", "model.qkv_bias=true"],
    "offload": ["remat.preset=offload_layer_inputs", "offload.optimizer=host"],
    "bf16_master_full_remat": ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
                               "precision.master_weights=true", "remat.preset=full"],
    # block-quantized AdamW state (jaxmem.optim; every kind is stored and stepped by the same stage code, int8's
    # codes are tests/integration/test_optimizer_states_steps.py's), bf16 weights without a master: each stage
    # rounds with bits of its own (its index folded in)
    "int4_bf16_stochastic_rounding": ["precision.moment_dtype=int4", "precision.param_dtype=bfloat16",
                                      "precision.master_weights=false"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEVERS))
def test_pipeline_levers_match_one_device(name):
    extra = LEVERS[name]
    want_metrics, want_state = _single(extra)
    cfg, pipe = _pipeline(LAYOUTS["pp2_fsdp4"], extra)
    metrics, state = _train(pipe, cfg)
    bf16 = "bf16" in name
    np.testing.assert_allclose([m[0] for m in metrics], [m[0] for m in want_metrics], rtol=1e-4 if bf16 else 2e-6)
    np.testing.assert_allclose([m[1] for m in metrics], [m[1] for m in want_metrics], rtol=1e-3 if bf16 else 2e-5)
    whole = pipe.whole_state(state, want_state)
    tol = dict(rtol=2e-2, atol=2e-3) if bf16 else dict(rtol=2e-5, atol=2e-6)
    # quantized moments: where another summation order moved a value across a code boundary, its later updates
    # differ (a few values in 10^4)
    share = 1e-3 if "int" in name else 0.0

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.mean(~np.isclose(a, b, **tol)) <= share, np.mean(~np.isclose(a, b, **tol))

    jax.tree.map(close, whole["params"], want_state["params"])


# ---------------------------------------------------------------- checkpoints and HF interop

RUN = ["train.seq_len=32", "train.grad_accum=2", "train.log_every=1", "train.progress=false",
       "checkpoint.every=2", "checkpoint.async_save=false"]
PP = ["parallel.pp=2", "parallel.fsdp=4", "train.micro_batch=2"]
FLAT = ["parallel.fsdp=8", "train.micro_batch=1"]  # the same 8 rows per micro-batch without a pipeline


def _run(out_dir, steps, layout):
    from jaxmem.train import run

    cfg = load_config("configs/tiny.yaml", RUN + layout + [f"out_dir={out_dir}", f"train.steps={steps}",
                                                           "optimizer.decay_steps=4"])
    return [(r["loss"], r["grad_norm"]) for r in run(cfg)["records"]]


@pytest.fixture(scope="module")
def straight_pipeline_run(tmp_path_factory):
    """The 4-step pipeline run's records and its checkpoints/ (steps 2 and 4)."""
    out_dir = tmp_path_factory.mktemp("straight")
    return _run(out_dir, 4, PP), out_dir / "checkpoints"


def _head_of_straight_run(out_dir, straight_pipeline_run):
    """out_dir/checkpoints/2 as a 2-step PP run leaves it: the straight run's step-2 checkpoint (the same steps,
    the same schedule: decay_steps=4 in both); returns the records of those 2 steps."""
    records, checkpoints = straight_pipeline_run
    shutil.copytree(checkpoints, out_dir / "checkpoints",
                    ignore=lambda d, names: ["4"] if d == str(checkpoints) else [])
    assert sorted(p.name for p in (out_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    return records[:2]


@pytest.mark.slow
@pytest.mark.parametrize("first, then", [
    (PP, FLAT),  # a pipeline checkpoint resumed without a pipeline
    (FLAT, PP + ["parallel.pp_layers=1,3"]),  # a flat checkpoint resumed by an uneven pipeline
    (PP, PP + ["parallel.pp_layers=3,1", "parallel.pp_schedule=gpipe"]),  # re-cut between pipelines
    (PP + ["offload.optimizer=host"], PP + ["offload.optimizer=host"]),  # host-resident stage state, same cut
])
def test_checkpoints_resume_across_layouts(tmp_path, first, then, straight_pipeline_run):
    """Steps 3-4 after a resume on another layout continue the 4-step pipeline run: same logical state. A head
    on the straight run's own layout is that run's step-2 checkpoint; other heads are trained here."""
    if first == PP:
        head = _head_of_straight_run(tmp_path, straight_pipeline_run)
    else:
        head = _run(tmp_path, 2, first)
    tail = _run(tmp_path, 4, then)
    np.testing.assert_allclose(head + tail, straight_pipeline_run[0], rtol=2e-5)


def test_hf_export_and_init_from_for_a_pipeline(tmp_path):
    from jaxmem.core.checkpoint import init_from
    from jaxmem.io.hf import load_hf, save_hf
    from jaxmem.cli.import_hf import main as import_hf_main

    cfg, pipe = _pipeline(LAYOUTS["pp2_fsdp4"], ["model.tie_embeddings=true"])
    _, state = _train(pipe, cfg, steps=1)
    save_hf(pipe.model(state), tmp_path / "hf")
    exported = jax.tree.map(np.asarray, jax.device_get(_pure(load_hf(tmp_path / "hf"))))
    trained = _pure(pipe.model(state))
    jax.tree.map(np.testing.assert_array_equal, exported, trained)
    import_hf_main([str(tmp_path / "hf"), str(tmp_path / "imported")])
    _, uneven = _pipeline(["parallel.pp=2", "parallel.fsdp=4", "train.micro_batch=2", "parallel.pp_layers=3,1"],
                          ["model.tie_embeddings=true"])
    started = init_from(uneven, tmp_path / "imported")
    assert [jax.tree.leaves(s["params"]["layers"])[0].shape[0] for s in started["stages"]] == [3, 1]
    jax.tree.map(np.testing.assert_array_equal, _pure(uneven.model(started)), trained)


def _pure(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.split(model)[1])


def test_eval_through_the_stages_equals_one_device():
    from jaxmem.train.evaluate import eval_step

    cfg, pipe = _pipeline(LAYOUTS["pp2_fsdp2_tp2"])
    one = build_program(load_config("configs/tiny.yaml", BASE + ["parallel.fsdp=1", f"train.micro_batch={ROWS}",
                                                                  f"train.grad_accum={ACCUM}"]),
                        devices=jax.devices()[:1])
    tokens = _tokens(7, cfg, pipe)
    got = pipe.eval_loss(pipe.init_state(), pipe.shard_batch(tokens))
    state = one.init_state()
    want = jax.device_get(eval_step(one)(state["params"], None, one.shard_batch(tokens)))
    np.testing.assert_allclose(got, [float(want[0]), float(want[1])], rtol=1e-6)


@pytest.mark.parametrize("damage", ["shapes", "chunk"])
def test_a_damaged_stage_in_a_checkpoint_is_named_not_read_as_zeros(tmp_path, damage, straight_pipeline_run):
    from jaxmem.config.schema import ConfigError

    _head_of_straight_run(tmp_path, straight_pipeline_run)  # a 2-step PP run's checkpoint
    stage = tmp_path / "checkpoints" / "2" / "stages" / "stage_1"
    if damage == "shapes":
        (stage / "shapes.json").unlink()
    else:  # one chunk of an Adam moment: a missing chunk must not read back as zeros
        chunks = sorted(p for p in (stage / "opt.layers.0.mu.wq" / "c").rglob("*") if p.is_file())
        assert len(chunks) == 4  # fsdp=4 shards, a chunk each
        chunks[0].unlink()
    with pytest.raises(ConfigError, match=r"checkpoints/2: checkpoint is incomplete or damaged.*delete this directory"):
        _run(tmp_path, 4, PP)


MOE = ["model.router_aux_loss_coef=0.1", "model.router_z_loss_coef=0.01"]
MOE_LAYOUTS = {**LAYOUTS, "pp2_ep2_fsdp2": ["parallel.pp=2", "parallel.ep=2", "parallel.fsdp=2", "train.micro_batch=2"]}


MOE_METRICS = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss")


def _train_moe(prog, cfg):
    out, state = _train(prog, cfg, keys=MOE_METRICS)
    return np.array(out), state


@pytest.fixture(scope="module")
def moe_reference():
    """tiny-moe trained on one device: (program, its metrics, its state), shared by the pipeline layouts."""
    cfg = load_config("configs/tiny-moe.yaml", BASE + MOE + ["parallel.fsdp=1", f"train.micro_batch={ROWS}",
                                                             f"train.grad_accum={ACCUM}"])
    one = build_program(cfg, devices=jax.devices()[:1])
    return (one, *_train_moe(one, cfg))


@pytest.mark.slow
@pytest.mark.parametrize("layout,kind", [("pp4_fsdp2", "gpipe"), ("pp2_ep2_fsdp2", "1f1b")])
def test_mixture_of_experts_pipeline_matches_one_device(layout, kind, moe_reference):
    """tiny-moe (router losses weighted 0.1 and 0.01): the stages pass the router statistics ahead and their
    cotangents back, so losses, gradient norms, router losses and params equal one device's; evaluation
    through the stages and each stage's compiled figures work too."""
    from jaxmem.train.evaluate import eval_step
    from jaxmem.pipeline.figures import stage_figures

    one, want, one_state = moe_reference
    cfg = load_config("configs/tiny-moe.yaml", BASE + MOE + [f"train.grad_accum={ACCUM}",
                                                             f"parallel.pp_schedule={kind}"] + MOE_LAYOUTS[layout])
    pipe = build_pipeline(cfg)
    got, state = _train_moe(pipe, cfg)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert want[0, 2] > 2.0 and want[0, 3] > 0  # the router losses are in the objective
    params = _pure(pipe.model(state))
    for path, a in jax.tree_util.tree_flatten_with_path(jax.device_get(one_state["params"]))[0]:
        b = params
        for k in path:
            b = b[k.key]
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, err_msg=jax.tree_util.keystr(path))
    tokens = _tokens(7, cfg, pipe)
    evaluated = pipe.eval_loss(state, pipe.shard_batch(tokens))
    expected = jax.device_get(eval_step(one)(one_state["params"], None, one.shard_batch(tokens)))
    np.testing.assert_allclose(evaluated, [float(expected[0]), float(expected[1])], rtol=1e-5)
    figures = stage_figures(pipe)
    assert len(figures) == cfg.parallel.pp and all(f.forward_peak > 0 and f.backward_peak > 0 for f in figures)
