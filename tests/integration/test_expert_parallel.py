"""Expert parallelism (parallel.ep, jaxmem.moe.expert_parallel): the all-to-all dispatch against the
single-device layer (forward and gradients, a router that sends everything to one device's experts),
the capacity-factor mode against a numpy reference of what it drops, training on the 8-device CPU mesh
with the losses of fsdp=8 (alone, with tp, with sp), the CLI, the weights' shardings, and the deviceless
H100 compile."""
import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from moe_explain import EP8, OVERRIDES, explained

from jaxmem import cli
from jaxmem.config import ConfigError
from jaxmem.loader import load_config
from jaxmem.config.schema import ParallelConfig
from jaxmem.moe import expert_parallel
from jaxmem.mesh import sharding
from jaxmem.core.layout import state_specs
from jaxmem.registry import build_program
from jaxmem.model.moe import dispatch_local, grouped_linear, grouped_mlp
from jaxmem.config.names import MOE_NAMES
from jaxmem.model.transformer import abstract_model

E, K, D, F = 8, 2, 16, 12
BASE = ["train.seq_len=32", "train.micro_batch=1", "optimizer.warmup_steps=0", "model.n_experts=8",
        "model.experts_per_token=2", "model.router_z_loss_coef=0.001"]
METRICS = ("loss", "moe_aux_loss", "moe_z_loss", "moe_dropped")


def _inputs(n_tokens, skew):
    """Token rows, routing weights and top-k experts; with `skew`, every token picks experts 6 and 7 (the
    last ep device's, at ep = 4): the worst case a dropless buffer must hold."""
    rng = np.random.RandomState(0)
    x = rng.randn(n_tokens, D).astype(np.float32)
    logits = rng.randn(n_tokens, E) + (np.where(np.arange(E) >= 6, 10.0, 0.0) if skew else 0.0)
    experts = np.argsort(-logits, axis=-1)[:, :K].astype(np.int32)
    weights = rng.rand(n_tokens, K).astype(np.float32)
    ws = tuple(rng.randn(*shape).astype(np.float32) * 0.3 for shape in ((E, D, F), (E, D, F), (E, F, D)))
    return x, weights, experts, ws


def _fp32_linear(lhs, w, group_sizes):
    return grouped_linear(lhs, w, group_sizes, jnp.float32)


def _ffn():
    return lambda rows, sizes, g, u, d: grouped_mlp(rows, sizes, g, u, d, activation="silu",
                                                    tag=lambda v, n: v, matmul=_fp32_linear)


def _run(experts_fn, x, weights, experts, ws, mesh=None):
    """(out, dropped, gradients of sum(out * probe) w.r.t. x, weights and the expert weights)."""
    probe = np.random.RandomState(1).randn(*x.shape).astype(np.float32)

    def loss(x, weights, ws):
        out, dropped = experts_fn(x, weights, jnp.asarray(experts), ws, _ffn(), lambda v, n: v)
        return jnp.sum(out * probe), (out, dropped)

    if mesh is not None:
        rows = NamedSharding(mesh, P(("fsdp", "ep"), None))
        x, weights = jax.device_put(x, rows), jax.device_put(weights, rows)
    grads, (out, dropped) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x, weights, ws)
    return np.asarray(out), int(dropped), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def mesh_ep4():
    return sharding.make_mesh(ParallelConfig(fsdp=2, ep=4))


@pytest.mark.parametrize("skew", [False, True])
def test_dispatch_matches_the_local_layer_forward_and_backward(mesh_ep4, skew):
    x, weights, experts, ws = _inputs(64, skew)
    ref_out, _, ref_grads = _run(dispatch_local, x, weights, experts, ws)
    out, dropped, grads = _run(expert_parallel.dispatcher(mesh_ep4), x, weights, experts, ws, mesh_ep4)
    assert dropped == 0
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
    assert np.abs(ref_out).max() > 0.1  # not a vacuous match


def _numpy_capped(x, weights, experts, ws, n_devices, ep, cap):
    """The capacity rule in numpy: per device (a contiguous block of tokens), per destination ep device,
    the assignments in (expert, token, slot) order past `cap` are dropped."""
    n, per_peer = x.shape[0] // n_devices, E // ep
    out, dropped = np.zeros_like(x, dtype=np.float64), 0
    for dev in range(n_devices):
        tokens = range(dev * n, (dev + 1) * n)
        assignments = sorted((experts[t, s], t, s) for t in tokens for s in range(K))
        sent = dict.fromkeys(range(ep), 0)
        for e, t, s in assignments:
            peer = e // per_peer
            sent[peer] += 1
            if sent[peer] > cap:
                dropped += 1
                continue
            g, u = x[t] @ ws[0][e], x[t] @ ws[1][e]
            out[t] += weights[t, s] * ((g / (1 + np.exp(-g))) * u) @ ws[2][e]
    return out, dropped


def test_capacity_factor_drops_what_the_numpy_rule_drops(mesh_ep4):
    x, weights, experts, ws = _inputs(64, skew=False)
    experts[:, 0] = np.where(np.arange(64) % 3 == 0, 0, experts[:, 0])  # expert 0 over-subscribed
    experts[:, 1] = np.where(experts[:, 1] == experts[:, 0], (experts[:, 0] + 1) % E, experts[:, 1])
    cap = expert_parallel.capacity(8, K, E, 4, 1.0)
    assert cap == 4  # 1.0 x 8 tokens x top 2 / 4 devices
    ref, ref_dropped = _numpy_capped(x.astype(np.float64), weights, experts, ws, 8, 4, cap)
    out, dropped, _ = _run(expert_parallel.dispatcher(mesh_ep4, 1.0), x, weights, experts, ws, mesh_ep4)
    assert dropped == ref_dropped > 0
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_capacity_is_the_worst_case_when_dropless():
    assert expert_parallel.capacity(10, 2, 8, 4, 0.0) == 20  # every token's 2 experts on one device
    assert expert_parallel.capacity(10, 8, 128, 8, 0.0) == 80
    assert expert_parallel.capacity(10, 4, 8, 4, 0.0) == 20  # at most 2 distinct experts per device
    assert expert_parallel.capacity(10, 2, 8, 4, 1.25) == 7  # ceil(1.25 x 10 x 2 / 4)


def test_expert_weights_split_over_ep_at_every_zero_stage():
    sizes = {"dp": 1, "fsdp": 2, "ep": 4, "sp": 1, "tp": 1}
    for stage in (1, 3):
        cfg = load_config("configs/tiny.yaml", BASE + ["parallel.ep=4", "parallel.fsdp=2",
                                                       f"parallel.zero_stage={stage}"])
        _, state = nnx.split(abstract_model(cfg.model))
        params, _, opt, _ = state_specs(cfg, state, sizes)
        layers = params["layers"]
        want = P(None, "ep", "fsdp", None) if stage == 3 else P(None, "ep", None, None)
        assert layers["expert_gate"] == want and layers["expert_down"] == want, layers["expert_gate"]
        assert opt["layers"]["expert_up"] == P(None, "ep", "fsdp", None)
        assert opt["embed"] == P(("fsdp", "ep"), None)  # ep holds different tokens: state shards over it
    assert sharding.mesh_shape(ParallelConfig(fsdp=-1, ep=4), 8) == {"dp": 1, "fsdp": 2, "ep": 4, "sp": 1, "tp": 1}
    with pytest.raises(ConfigError, match=r"dp\*fsdp\*ep\*sp\*tp=16"):
        sharding.mesh_shape(ParallelConfig(fsdp=4, ep=4), 8)


def _train(overrides, rows=8, steps=3):
    cfg = load_config("configs/tiny.yaml", BASE + overrides)
    prog = build_program(cfg, devices=jax.devices())
    state, step = prog.init_state(), prog.jit_step()
    out = []
    for _ in range(steps):
        toks = np.random.default_rng(0).integers(0, 256, size=(rows, cfg.train.seq_len + 1)).astype(np.int32)
        state, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
        out.append([float(m[k]) for k in METRICS])
    return np.array(out)


@pytest.fixture(scope="module")
def fsdp8():
    return _train(["parallel.fsdp=8"])


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["parallel.ep=4", "parallel.fsdp=2"],
    ["parallel.ep=2", "parallel.tp=2", "parallel.fsdp=2", "parallel.rules=fsdp_tp", "train.micro_batch=2"],
    ["parallel.ep=2", "parallel.sp=2", "parallel.fsdp=2", "train.micro_batch=2"],
    ["parallel.ep=4", "parallel.fsdp=2", "remat.preset=full", "remat.names.moe_dispatch=device",
     "remat.names.expert_act=device"],
], ids=["ep4_fsdp2", "ep2_tp2_fsdp2", "ep2_sp2_fsdp2", "ep4_fsdp2_remat_saving_expert_names"])
def test_ep_trains_like_fsdp8(fsdp8, overrides):
    """Dropless: the same global batch gives the same losses, router losses and no drops."""
    assert fsdp8[-1, 0] < fsdp8[0, 0] - 0.3, fsdp8
    ep = _train(overrides)
    np.testing.assert_allclose(ep, fsdp8, rtol=1e-4)
    assert np.all(ep[:, 3] == 0)


@pytest.mark.slow
def test_the_cli_trains_a_moe_with_ep2(tmp_path, capsys):
    rc = cli.main(["train", "configs/tiny.yaml", "model.n_experts=8", "model.experts_per_token=2",
                   "parallel.ep=2", "train.steps=3", "train.log_every=1", "train.seq_len=32",
                   f"out_dir={tmp_path}"])
    assert rc == 0, capsys.readouterr()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["loss"] < records[0]["loss"] and all(r["moe_dropped"] == 0 for r in records)


def test_a_remat_policy_saves_the_named_rows_inside_the_dispatch(mesh_ep4):
    """The names tagged inside the shard_map reach the policy: saving moe_dispatch and expert_act keeps the
    received rows [ep x C, D] and the experts' activation [ep x C, F] as residuals; saving nothing keeps neither."""
    x, weights, experts, ws = _inputs(64, skew=False)
    rows = NamedSharding(mesh_ep4, P(("fsdp", "ep"), None))
    x, weights = jax.device_put(x, rows), jax.device_put(weights, rows)
    ws = tuple(jax.device_put(w, NamedSharding(mesh_ep4, P("ep"))) for w in ws)
    dispatch = expert_parallel.dispatcher(mesh_ep4)
    ffn = lambda r, sizes, g, u, d: grouped_mlp(r, sizes, g, u, d, activation="silu",  # noqa: E731
                                               tag=checkpoint_name, matmul=_fp32_linear)

    def loss(x, ws):
        return jnp.sum(dispatch(x, weights, jnp.asarray(experts), ws, ffn, checkpoint_name)[0])

    def residuals(policy):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy), x, ws)
        return out.getvalue()

    received = 8 * 4 * expert_parallel.capacity(8, K, E, 4, 0.0)  # 8 devices x ep x C rows (8 tokens each)
    names = (f"f32[{received},{D}] output of shard_map", f"f32[{received},{F}] output of shard_map")
    saved = residuals(jax.checkpoint_policies.save_only_these_names("moe_dispatch", "expert_act"))
    assert all(n in saved for n in names), saved
    nothing = residuals(jax.checkpoint_policies.nothing_saveable)
    assert not any(n in nothing for n in names), nothing


def test_checkpoint_names_survive_the_dispatch():
    cfg = load_config("configs/tiny.yaml", BASE + ["parallel.ep=4", "parallel.fsdp=2"])
    prog = build_program(cfg, devices=jax.devices())
    jaxpr = str(jax.make_jaxpr(prog.step_fn())(prog.abstract_state, prog.abstract_batch()))
    assert "all_to_all" in jaxpr and "shard_map" in jaxpr
    for name in MOE_NAMES:
        assert f"name={name}" in jaxpr, name


@pytest.mark.slow
def test_deviceless_h100x8_ep8_step(built_once):
    """tiny-moe with parallel.ep=8 builds for 8 x H100: the dispatch's all-to-alls in the optimized HLO (the
    compile test_moe_plan_compiled explains, shared through built_once); with ep=1 no dispatch is lowered."""
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.plan import hlo_dump
    from jaxmem.runtime import aot

    report, dump = explained(built_once, "moe_explain_ep8_capacity", EP8)
    hlo = hlo_dump.find_dump(dump)[0].read_text()
    dispatch = [line for line in hlo.splitlines() if "all-to-all" in line and "shard_map/all_to_all" in line]
    assert len(dispatch) >= 2
    assert 0 < report["compiled_device_bytes"] < 2**30
    # ep=1 is only lowered: a dispatch is a shard_map all_to_all already in the lowered program (as in ep=8's),
    # and GSPMD's own all-to-alls (it may reshard the grouped matmul's blocks with some) come only with a compile
    lowered = {}
    for ep, layout in ((1, ["parallel.fsdp=8"]), (8, EP8)):
        cfg = load_config("configs/tiny-moe.yaml", OVERRIDES + layout)
        lowered[ep] = build_program(cfg, devices=aot.target_devices("h100-80g", 8)).lower().as_text()
    assert "all_to_all" in lowered[8] and "all_to_all" not in lowered[1]
