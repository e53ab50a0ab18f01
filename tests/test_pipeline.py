"""Pipeline parallelism: schedules, layer partitions, numerics against one device, checkpoints across
layouts, HF export, and the per-stage compiled plan."""
import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError, load_config
from jaxmem.pipeline import partition, schedule
from jaxmem.pipeline.runtime import build_pipeline
from jaxmem.program import build_program

# As tests/test_parallel.py: a large Adam eps makes params after a few steps compare gradients.
BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "optimizer.lr=1e-1", "optimizer.eps=1e-1",
        "checkpoint.enabled=false"]
STEPS, ROWS, ACCUM = 3, 8, 4


def _tokens(step, cfg, prog):
    toks = np.random.default_rng(step).integers(0, 256, size=(ACCUM * prog.rows, cfg.train.seq_len + 1))
    return toks.astype(np.int32).reshape(prog.batch_shape)


def _train(prog, cfg, steps=STEPS, state=None, start=0):
    state = prog.init_state() if state is None else state
    step, out = prog.jit_step(), []
    for i in range(start, start + steps):
        state, m = step(state, prog.shard_batch(_tokens(i, cfg, prog)))
        out.append((float(m["loss"]), float(m["grad_norm"])))
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


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
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


LEVERS = {  # tied embeddings (the last stage's copy), bf16 + fp32 master, remat, activation and optimizer offload
    "tied": ["model.tie_embeddings=true"],
    "offload": ["remat.preset=offload_layer_inputs", "offload.optimizer=host"],
    "bf16_master_full_remat": ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
                               "precision.master_weights=true", "remat.preset=full"],
}


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
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         **tol), whole["params"], want_state["params"])


# ---------------------------------------------------------------- schedules and partitions


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, micro", [(2, 4), (4, 8), (4, 2), (3, 5)])
def test_schedule_order_respects_the_data_flow(kind, pp, micro):
    s = schedule.build(kind, pp, micro)
    seen = set()
    for stage, op, m in s.order:
        if op == "F":
            assert stage == 0 or (stage - 1, "F", m) in seen
        else:
            assert (stage, "F", m) in seen and (stage == pp - 1 or (stage + 1, "B", m) in seen)
        seen.add((stage, op, m))
    assert len(seen) == 2 * pp * micro
    want = [micro] * pp if kind == "gpipe" else [min(pp - i, micro) for i in range(pp)]
    assert list(s.in_flight) == want
    assert s.bubble == pytest.approx((pp - 1) / (micro + pp - 1))


def test_layer_counts_and_their_errors():
    assert partition.even_counts(10, 4) == (2, 2, 3, 3)
    assert partition.even_counts(80, 2) == (40, 40)
    cfg = load_config("configs/tiny.yaml", ["parallel.pp=2", "parallel.pp_layers=1,3"])
    assert partition.layer_counts(cfg) == (1, 3)
    assert partition.layer_counts(load_config("configs/tiny.yaml", ["parallel.pp=2", "parallel.pp_layers=auto"])) is None
    for bad in ("2,3", "4,0", "1,1,2", "x,y"):
        with pytest.raises(ConfigError, match="^parallel.pp_layers:"):
            load_config("configs/tiny.yaml", ["parallel.pp=2", f"parallel.pp_layers={bad}"])
    with pytest.raises(ConfigError, match="^parallel.pp: 8 stages need"):
        load_config("configs/tiny.yaml", ["parallel.pp=8"])
    with pytest.raises(ConfigError, match="^remat.every_k: 2 does not divide model.n_layers=1"):
        load_config("configs/tiny.yaml", ["parallel.pp=2", "parallel.pp_layers=1,3", "remat.granularity=every_k",
                                          "remat.every_k=2"])


@pytest.mark.parametrize("key, value", [("lora.rank", "8"), ("optimizer.update_in_backward", "true"),
                                        ("offload.params", "host")])
def test_levers_a_pipeline_refuses_by_name(key, value):
    extra = ["remat.preset=full", "train.grad_accum=1"] if key != "lora.rank" else []
    with pytest.raises(ConfigError, match=f"^{key}: not supported with parallel.pp > 1"):
        load_config("configs/tiny.yaml", ["parallel.pp=2", f"{key}={value}"] + extra)


def test_split_and_merge_are_inverse():
    whole = {"params": {"embed": np.arange(6.0).reshape(3, 2), "final_norm": np.ones(2),
                        "layers": {"w": np.arange(20.0).reshape(5, 4)}}, "step": np.int32(3)}
    templates = [{"params": {"embed": 0, "layers": {"w": np.zeros((2, 4))}}, "step": 0},
                 {"params": {"final_norm": 0, "layers": {"w": np.zeros((3, 4))}}, "step": 0}]
    stages = partition.split_tree(whole, templates, (2, 3))
    np.testing.assert_array_equal(stages[1]["params"]["layers"]["w"], whole["params"]["layers"]["w"][2:])
    back = partition.merge_tree(stages, whole)
    jax.tree.map(np.testing.assert_array_equal, back, whole)
