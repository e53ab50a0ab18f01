"""Pipeline plans compiled deviceless per stage (parallel.pp_layers=auto against the even split, each
stage's figures and warnings, the host figure of the largest stage) and the per-process stage compile cache."""
import json

import jax
import numpy as np
import pytest

from jaxmem.loader import load_config
from jaxmem.registry import build_pipeline

pytestmark = pytest.mark.slow  # deviceless compiles of a 1B model's pipeline stages, shared by every test here

# 4 layers: the balancer's two-layer probe is the even split itself (compiled once per process), and the split
# it finds is the one the first test moves to; with 8 layers each of them was a pipeline compiled of its own
PLAN = ["model.preset=llama3.2-1b", "model.n_layers=4", "train.seq_len=1024", "train.micro_batch=1",
        "train.grad_accum=4", "parallel.pp=2", "parallel.fsdp=4", "precision.param_dtype=bfloat16",
        "precision.compute_dtype=bfloat16", "remat.preset=selective", "target.name=h100-80g"]


@pytest.fixture(scope="module")
def auto_plan(built_once):
    from jaxmem.runtime.aot import resolve_topology
    from jaxmem.plan import plan

    def build(directory):
        cfg = load_config("configs/tiny.yaml", PLAN + ["parallel.pp_layers=auto"])
        (directory / "plan.json").write_text(json.dumps(plan(cfg, resolve_topology(cfg, None, None, None))))

    return json.loads((built_once("pipeline_auto_plan", build) / "plan.json").read_text())


def _stage_totals(bills):
    return [b["device_total"] for b in bills]


def test_moving_a_layer_off_the_heavy_stage_lowers_its_compiled_peak(auto_plan):
    from jaxmem.runtime.aot import resolve_topology
    from jaxmem.pipeline.plan import stage_figures

    even = _stage_totals(auto_plan["pipeline"]["even_stage_bills"])
    assert auto_plan["pipeline"]["even_layers"] == [2, 2]
    heavy = int(np.argmax(even))  # here the last: the LM head and loss over a 128K vocabulary
    counts = (3, 1) if heavy == 1 else (1, 3)
    cfg = load_config("configs/tiny.yaml", PLAN)
    moved = stage_figures(build_pipeline(cfg, list(resolve_topology(cfg, None, None, None).devices()),
                                         counts=counts))
    assert moved[heavy].device_total < even[heavy]  # a layer fewer: its state, grads and residuals
    assert moved[1 - heavy].device_total > even[1 - heavy]


def test_auto_is_never_worse_than_even_and_the_plan_shows_every_stage(auto_plan, capsys):
    from rich.console import Console

    from jaxmem.plan.report import render

    info = auto_plan["pipeline"]
    assert max(_stage_totals(info["stage_bills"])) <= max(_stage_totals(info["even_stage_bills"]))
    assert sum(info["layers"]) == 4 and info["layers"] != [2, 2]  # the even split is not the best here
    assert info["in_flight"] == [2, 1] and info["bubble"] == pytest.approx(1 / 5)
    worst = max(info["stage_bills"], key=lambda b: b["device_total"])
    assert auto_plan["compiled"]["device_total"] == worst["device_total"]
    assert "pipeline stage" in auto_plan["compiled"]["label"] and "deviceless" in auto_plan["compiled"]["label"]
    render(auto_plan, Console(width=200))
    out = capsys.readouterr().out
    assert "pipeline stages, layers" in out and "even split for comparison, layers [2, 2]" in out


def test_the_plan_names_each_stage_that_does_not_fit(auto_plan):
    from jaxmem.pipeline.plan import StageFigures, stage_warnings

    bills = [StageFigures(**{k: v for k, v in b.items() if k in StageFigures.__dataclass_fields__})
             for b in auto_plan["pipeline"]["stage_bills"]]
    totals = [b.device_total for b in bills]
    assert totals == _stage_totals(auto_plan["pipeline"]["stage_bills"])
    between = (min(totals) + max(totals)) // 2
    heavy = int(np.argmax(totals))
    assert stage_warnings(bills, between) == [
        f"pipeline stage {heavy} ({bills[heavy].layers} layers, {bills[heavy].in_flight} micro-batches in flight) "
        f"does not fit: {totals[heavy] / 2**30:.2f} GiB > {between / 2**30:.2f} GiB usable"]
    assert stage_warnings(bills, max(totals)) == []


def test_the_plans_host_figure_is_the_largest_stages_not_the_worst_device_stages(auto_plan):
    """A node may hold another stage than the one with the largest device total: the plan's host bytes (and
    so its host RAM per node) are the largest stage's (the first stage's embedding state on the host made
    2 x 8 H100 pp=2 need 726 GiB per node where the plan said 566)."""
    import dataclasses

    from jaxmem.pipeline.plan import StageFigures, _as_compiled
    from jaxmem.plan.compiled import CompiledFigures
    from jaxmem.runtime.aot import resolve_topology

    bills = [StageFigures(**{k: v for k, v in b.items() if k in StageFigures.__dataclass_fields__})
             for b in auto_plan["pipeline"]["stage_bills"]]
    worst = max(range(2), key=lambda i: bills[i].device_total)
    bills[1 - worst] = dataclasses.replace(bills[1 - worst], state_host=3 * 2**30)
    host = max(f.host_total for f in bills)
    cfg = load_config("configs/tiny.yaml", PLAN)
    compiled = _as_compiled(bills[worst], resolve_topology(cfg, None, None, None), 2, host, CompiledFigures)
    assert compiled.host_total == 3 * 2**30 > bills[worst].host_total
    assert compiled.device_total == bills[worst].device_total


def test_a_stage_compiled_for_two_topologies_gets_each_ones_devices():
    """The per-process stage compile cache hands back output shardings on the devices asked for: 8 x H100 and
    2 x 8 x H100 number their compile-only devices alike, and a stage program shared by two plans (same text,
    same ids) came back on the first topology's devices ("incompatible devices" in the next lowering)."""
    pytest.importorskip("jax_cuda12_plugin")
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmem.pipeline.figures import _compile
    from jaxmem.runtime.aot import target_devices

    def compiled(devices):
        mesh = jax.sharding.Mesh(np.array(devices[:4]), ("fsdp",))
        x = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("fsdp")))
        return _compile(jax.jit(lambda a: a * 2).lower(x), devices[:4])

    one, two = target_devices("h100-80g", 8), target_devices("h100-80g", 8, hosts=2)
    for devices in (one, two):
        assert set(compiled(list(devices)).output_shardings.device_set) == set(devices[:4])
