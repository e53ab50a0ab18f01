"""Plug-ins (jaxmem.core.plugins): the registry picks one per config, and the program and the checkpointer
reach an add-on only through its hooks (a feature defined here, unknown to jaxmem, handed to the core, changes
them alone)."""
import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.registry import build_program, plugin_for, run_meta
from jaxmem.core import program
from jaxmem.core.plugins import FROZEN, Feature, Features, ProgramPlugin
from jaxmem.inbackward.step import UpdateInBackward
from jaxmem.core.checkpoint import Checkpoints, _saved_shapes, restore_run
from jaxmem.lora.plugin import LoraPlugin

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHORT = ["train.seq_len=16", "train.micro_batch=1"]


def _cfg(*overrides, path=CONFIGS / "tiny.yaml"):
    return load_config(path, [*SHORT, *overrides])


def test_the_registry_picks_one_plugin_per_config():
    assert type(plugin_for(_cfg())) is ProgramPlugin
    lora = plugin_for(_cfg("lora.rank=4", "lora.base_dtype=nf4", "lora.alpha=8"))
    assert type(lora) is LoraPlugin and (lora.setup.rank, lora.setup.base_dtype, lora.setup.scale) == (4, "nf4", 2.0)
    assert type(plugin_for(_cfg(path=CONFIGS / "levers" / "update-in-backward.yaml"))) is UpdateInBackward


class _DoubledHead(ProgramPlugin):
    """Reads the LM head at twice its weight; its step is a marker."""

    def head_weight(self, prog, frozen, model):
        return 2 * super().head_weight(prog, frozen, model)

    def make_step(self, prog, loss_sum_fn):
        return "replaced step"


@pytest.fixture(scope="module")
def one_device_program():
    return build_program(_cfg("parallel.fsdp=1"), devices=jax.devices()[:1])


def test_the_forward_and_the_step_come_from_the_plugin(one_device_program):
    prog = one_device_program
    plugged = dataclasses.replace(prog, plugin=_DoubledHead())
    params = prog.fresh_params(0)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, prog.cfg.model.vocab_size)
    loss = lambda p, q: jax.jit(program.loss_sum_fn(p))(q, tokens[:, :-1], tokens[:, 1:])[0]  # noqa: E731
    doubled = dict(params, lm_head=2 * params["lm_head"])  # the reference: the plain program on doubled weights
    got, want, plain = loss(plugged, params), loss(prog, doubled), loss(prog, params)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert abs(float(got) - float(plain)) > 0.05  # the hook changed the loss (0.25 of a 175 sum; noise ~1e-5)
    assert plugged.step_fn() == "replaced step"


def test_lora_meta_names_its_base_and_a_resume_checks_it():
    cfg = _cfg("lora.rank=4", "lora.base_dtype=nf4", "lora.double_quant=true", "train.seed=3")
    meta = run_meta(cfg, step=5, data_position=10, batch_rows=2)
    assert meta["lora_base"] == "tiny seed 3, nf4 double-quantized"
    assert "lora_base" not in run_meta(_cfg(), step=5, data_position=10, batch_rows=2)
    plugin = plugin_for(cfg)
    plugin.check_meta(cfg, meta, "ckpt")  # its own base: accepted
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=4))
    with pytest.raises(ConfigError, match="ckpt: these adapters belong to the base 'tiny seed 3, nf4 double-q"):
        plugin.check_meta(other, meta, "ckpt")


class _FrozenCopy(ProgramPlugin):
    """Keeps a frozen copy of the initial params beside the state, rebuilt from the seed on restore."""

    def frozen_layout(self, layout):
        return {FROZEN: (layout.abstract_params, layout.param_specs)}

    def fresh_state(self, prog, params, seed):
        return dict(super().fresh_state(prog, params, seed), **{FROZEN: params})

    def frozen_part(self, prog, load_params):
        return jax.jit(lambda: prog.fresh_params(prog.cfg.train.seed), out_shardings=prog.state_shardings[FROZEN])()


class _FrozenCopyFeature(Feature):
    name = "frozen_copy"

    def program_plugin(self, cfg):
        return _FrozenCopy()


def test_the_checkpointer_saves_and_rebuilds_what_the_plugin_says(tmp_path):
    prog = program.build_program(_cfg("parallel.fsdp=1", f"out_dir={tmp_path}"), devices=jax.devices()[:1],
                                 features=Features((_FrozenCopyFeature(),)))
    assert prog.abstract_state[FROZEN]["embed"].shape == (256, 128)  # the frozen entry of frozen_layout
    state = prog.init_state()
    ckpts = Checkpoints(tmp_path / "checkpoints", async_save=False)
    ckpts.save(0, state, run_meta(prog.cfg, 0, 0, 1))
    restored, meta = restore_run(prog, ckpts, 0)
    ckpts.close()
    assert meta["step"] == 0 and set(restored) == set(state)
    leaves = lambda t: [np.asarray(x) for x in jax.tree.leaves(t)]  # noqa: E731
    for got, want in zip(leaves(restored), leaves(state), strict=True):  # the rebuilt base included
        np.testing.assert_array_equal(got, want)
    on_disk = _saved_shapes(tmp_path / "checkpoints" / "0" / "state")
    assert "params.embed" in on_disk and not [k for k in on_disk if k.startswith(FROZEN)]  # never saved


class _Priced(Feature):
    """A feature unknown to jaxmem that trains 1000 elements beside the model, adds its own collectives and
    counts 7 parameters a token does not use."""

    name = "priced"
    cost_constants = {"priced_rate": 0.5}

    def applies(self, cfg) -> bool:
        return True

    def extra_trained_params(self, cfg) -> int:
        return 1000

    def collective_seconds(self, cfg, bill, gpu, grad_accum: int) -> float:
        return 1.5

    def parameter_counts(self, cfg, counts: dict) -> dict:
        return dict(counts, active=counts["active"] - 7)


def test_the_cost_model_and_the_plan_reach_a_feature_only_through_its_hooks(monkeypatch):
    from jaxmem import registry
    from jaxmem.config.targets import get_target
    from jaxmem.model.presets import param_count
    from jaxmem.plan.bill import compute_bill
    from jaxmem.plan.costmodel import estimate
    from jaxmem.plan.report import parameter_counts

    cfg = _cfg("train.grad_accum=1")
    bill, gpu = compute_bill(cfg, 1), get_target("h100-80g")
    before = estimate(cfg, bill, gpu, 1, 1, bill.layout.rows)
    assert parameter_counts(cfg) == {"total": param_count(cfg.model), "active": param_count(cfg.model)}
    assert "priced_rate" not in before.to_json()["constants"]
    monkeypatch.setattr(registry, "FEATURES", registry.FEATURES + (_Priced(),))
    after = estimate(cfg, bill, gpu, 1, 1, bill.layout.rows)
    assert after.model_flops == pytest.approx(before.model_flops + 6.0 * 1000 * before.tokens_per_step)
    assert after.breakdown["matmul_flops"] == pytest.approx(
        before.breakdown["matmul_flops"] + 3 * 2.0 * 1000 * before.tokens_per_step)
    assert after.collective_seconds == pytest.approx(before.collective_seconds + 1.5)
    assert after.to_json()["constants"]["priced_rate"] == 0.5
    assert parameter_counts(cfg)["active"] == param_count(cfg.model) - 7
