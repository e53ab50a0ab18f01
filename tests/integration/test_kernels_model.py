"""The tiny model's loss and grads with each kernel choice equal the XLA path's, on 1 device and on meshes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem import kernels
from jaxmem.mesh import sharding
from jaxmem.loader import load_config
from jaxmem.kernels.cross_entropy.reference import IGNORE_INDEX
from jaxmem.mesh.axes import activation_rules
from jaxmem.registry import build_program
from kernel_checks import assert_close

SEQ = 32
MESHES = {
    "1 device": (["parallel.fsdp=1"], 1),
    "fsdp=8": (["parallel.fsdp=8"], 8),
    "fsdp=4 x tp=2": (["parallel.fsdp=4", "parallel.tp=2", "parallel.rules=fsdp_tp"], 8),
}
BASELINE = ["kernels.loss=naive", "kernels.attention=xla", "kernels.norm=xla"]
FUSED = ["kernels.loss=pallas", "kernels.attention=pallas", "kernels.norm=pallas", "kernels.attn_block_q=16",
         "kernels.attn_block_k=16", "kernels.z_loss=1e-3"]
CHUNKED = ["kernels.loss=chunked", "kernels.loss_block_t=48", "kernels.loss_block_v=96", "kernels.z_loss=1e-3"]


def _program(mesh_overrides, n_devices, kernel_overrides):
    base = ["model.preset=tiny", f"train.seq_len={SEQ}", "train.micro_batch=2", "remat.preset=none"]
    cfg = load_config(None, base + mesh_overrides + kernel_overrides)
    return build_program(cfg, devices=jax.devices()[:n_devices])


def _batch(rows):
    k = jax.random.split(jax.random.key(1), 2)
    tokens = jax.random.randint(k[0], (rows, SEQ + 1), 0, 256)
    labels = jnp.where(jax.random.bernoulli(k[1], 0.2, (rows, SEQ)), IGNORE_INDEX, tokens[:, 1:])
    return tokens[:, :-1], labels


def _loss_and_grads(prog, params, inputs, labels):
    """Mean loss over valid tokens and its grads, built the way program.py builds the train loss."""
    mesh = prog.mesh
    loss_impl = kernels.select_loss(prog.cfg.kernels, kernels.platform_of(mesh.devices.flat), mesh=mesh)
    constrainer = sharding.activation_constrainer(sharding.RULE_TABLES[prog.cfg.parallel.rules], mesh)

    def loss(params):
        model = prog.model(params)
        with activation_rules(constrainer):
            h_btd = model.hidden(inputs, prog.ctx)
        w_dv = model.lm_head_weight().astype(prog.precision.compute)
        loss_sum, n_valid = loss_impl(h_btd.reshape(-1, h_btd.shape[-1]), w_dv, labels.reshape(-1))
        return loss_sum / n_valid

    return jax.jit(jax.value_and_grad(loss))(params)


@functools.cache
def _baseline(mesh_name):
    prog = _program(*MESHES[mesh_name], BASELINE)
    params = prog.init_state()["params"]
    inputs, labels = _batch(prog.rows)
    z_loss = jax.tree.map(np.asarray, _loss_and_grads(_program(*MESHES[mesh_name], BASELINE + ["kernels.z_loss=1e-3"]),
                                                      params, inputs, labels))
    return params, inputs, labels, z_loss


_SLOW = pytest.mark.slow  # interpret-mode Pallas inside the whole model: ~1 min each on 2 cores
CASES = [pytest.param("fsdp=4 x tp=2", FUSED, id="pallas-fsdp_tp"),
         pytest.param("1 device", FUSED, id="pallas-1dev", marks=_SLOW),
         pytest.param("fsdp=8", FUSED, id="pallas-fsdp8", marks=_SLOW)]
CASES += [pytest.param(name, CHUNKED, id=f"chunked-{name}") for name in MESHES]


@pytest.mark.parametrize("mesh_name,kernel_overrides", CASES)
def test_model_loss_and_grads_match_xla(mesh_name, kernel_overrides):
    params, inputs, labels, (ref_loss, ref_grads) = _baseline(mesh_name)
    prog = _program(*MESHES[mesh_name], kernel_overrides)
    loss, grads = _loss_and_grads(prog, params, inputs, labels)
    assert_close(loss, ref_loss, 1e-5, "loss")
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for (path, r), g in zip(flat_ref, flat):
        assert_close(g, r, 1e-4, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_train_step_with_fused_kernels_matches_xla_on_fsdp_tp():
    """One real `jit_step` on fsdp=4 x tp=2: same loss, grad norm and updated params."""
    mesh_overrides, n = MESHES["fsdp=4 x tp=2"]
    results = []
    for overrides in (BASELINE, [o for o in FUSED if "z_loss" not in o]):
        prog = _program(mesh_overrides, n, overrides)
        state = prog.init_state()
        tokens = jax.random.randint(jax.random.key(2), prog.batch_shape, 0, 256)
        new_state, metrics = prog.jit_step()(state, {"tokens": jax.device_put(tokens, prog.batch_sharding)})
        results.append((metrics, jax.tree.map(np.asarray, new_state["params"])))
    (m_ref, p_ref), (m, p) = results
    assert_close(m["loss"], m_ref["loss"], 1e-5, "loss")
    assert_close(m["grad_norm"], m_ref["grad_norm"], 1e-4, "grad_norm")
    for (path, r), x in zip(jax.tree_util.tree_leaves_with_path(p_ref), jax.tree.leaves(p)):
        assert_close(x, r, 1e-4, jax.tree_util.keystr(path))


@pytest.mark.slow
def test_fused_kernels_shrink_the_compiled_h100_step():
    """The step `plan` compiles (deviceless, 8 x h100-80g) holds fewer bytes with the kernels than with XLA."""
    from jaxmem.runtime.aot import target_devices
    from jaxmem.runtime.compiled_memory import memory_figures

    base = ["model.preset=llama3.2-1b", "train.seq_len=8192", "train.micro_batch=1", "remat.preset=full",
            "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"]
    totals = {}
    for name, overrides in (("xla", BASELINE), ("auto", ["kernels.loss=auto", "kernels.attention=auto",
                                                         "kernels.norm=auto"])):
        prog = build_program(load_config(None, base + overrides), devices=target_devices("h100-80g", 8))
        totals[name] = memory_figures(prog.lower().compile())["device"]
    # XLA attention keeps [heads, T, T] scores (4 GiB per layer at 32 x 8192^2 fp32); the kernels do not
    assert totals["auto"] < 0.7 * totals["xla"], totals
