"""tune and sweep search `parallel.ep` for a mixture of experts (jaxmem/moe/search.py): only values that
divide the experts and the devices, only where validate accepts them (none above 1 until expert parallelism
exists), never for a dense model."""
import pytest

from jaxmem.moe import search as ep_search
from jaxmem.loader import load_config
from jaxmem.config.schema import ConfigError


def test_candidates_divide_experts_and_devices():
    assert ep_search.ep_candidates(128, 8) == [1, 2, 4, 8]
    assert ep_search.ep_candidates(8, 16) == [1, 2, 4, 8]
    assert ep_search.ep_candidates(6, 8) == [1, 2]
    assert ep_search.ep_candidates(60, 12) == [1, 2, 3, 4, 6, 12]
    for n_experts, n_devices in ((128, 8), (8, 16), (6, 8), (60, 12)):
        for ep in ep_search.ep_candidates(n_experts, n_devices):
            assert n_experts % ep == 0 and n_devices % ep == 0
    assert ep_search.ep_candidates(0, 8) == [1]  # a dense model


def test_ep_mesh_fills_the_devices():
    over = ep_search.ep_overrides(4, 8)
    assert "parallel.ep=4" in over and "parallel.fsdp=2" in over and "parallel.zero_stage=3" in over


def test_only_accepted_values_come_out():
    def accept_all(overrides):
        return overrides

    assert ep_search.accepted_ep_values(accept_all, 8, 8) == [1, 2, 4, 8]
    assert ep_search.ep_mesh_options(accept_all, 8, 8) == [ep_search.ep_overrides(ep, 8) for ep in (2, 4, 8)]

    def refuse_above_two(overrides):
        if any(o.startswith("parallel.ep=") and int(o.split("=")[1]) > 2 for o in overrides):
            raise ConfigError("parallel.ep: too large")
        return overrides

    assert ep_search.accepted_ep_values(refuse_above_two, 8, 8) == [1, 2]


def test_experts_that_split_give_every_dividing_ep():
    """tiny-moe (8 experts) on 8 GPUs: every ep dividing both validates, each mesh fills fsdp with the rest."""
    def load(overrides):
        return load_config("configs/tiny-moe.yaml", overrides + ["target.gpus_per_host=8"])

    assert ep_search.accepted_ep_values(load, 8, 8) == [1, 2, 4, 8]
    meshes = ep_search.ep_mesh_options(load, 8, 8)
    pairs = [(next(o for o in m if o.startswith("parallel.ep=")), next(o for o in m if o.startswith("parallel.fsdp=")))
             for m in meshes]
    assert pairs == [("parallel.ep=2", "parallel.fsdp=4"), ("parallel.ep=4", "parallel.fsdp=2"),
                     ("parallel.ep=8", "parallel.fsdp=1")]
    grid = ep_search.expand_auto_ep({"parallel.ep": ["auto"], "remat.preset": ["full"]}, load, 8, 8)
    assert grid == {"parallel.ep": ["1", "2", "4", "8"], "remat.preset": ["full"]}
    # 6 experts on 8 GPUs: only the ep values dividing both (1, 2)
    six = lambda o: load_config("configs/tiny-moe.yaml", o + ["target.gpus_per_host=8", "model.n_experts=6"])  # noqa: E731
    assert ep_search.accepted_ep_values(six, 6, 8) == [1, 2]


def test_a_dense_model_never_gets_ep():
    calls = []

    def load(overrides):
        calls.append(overrides)
        return overrides

    assert ep_search.ep_mesh_options(load, 0, 8) == [] and calls == []
    assert ep_search.expand_auto_ep({"parallel.ep": ["auto"]}, load, 0, 8) == {"parallel.ep": ["1"]}


@pytest.mark.parametrize("config,expect_ep", [("configs/tiny.yaml", False), ("configs/tiny-moe.yaml", True)])
def test_tuner_meshes_get_ep_for_experts_only(config, expect_ep, tmp_path):
    from jaxmem.cli.tune import Tuner

    tuner = Tuner(config, [], {"name": "h100-80g", "gpus_per_host": 8}, 16, 60, tmp_path, 0)
    assert any("parallel.fsdp=8" in m for m in tuner.meshes)
    assert any(any(o.startswith("parallel.ep=") for o in m) for m in tuner.meshes) == expect_ep


def test_tuner_adds_accepted_ep_meshes_for_experts_only(monkeypatch, tmp_path):
    """With a validate that accepts ep (as the expert-parallel branch will), the MoE tuner tries ep meshes and
    the dense one still does not."""
    from jaxmem.cli import tune

    accept_all = ep_search.ep_mesh_options  # the mixture of experts' search (its feature calls it)
    monkeypatch.setattr(ep_search, "ep_mesh_options",
                        lambda load, n_experts, n: accept_all(lambda o: o, n_experts, n))
    moe = tune.Tuner("configs/tiny-moe.yaml", [], {"name": "h100-80g", "gpus_per_host": 8}, 16, 60, tmp_path, 0)
    assert [m for m in moe.meshes if "parallel.ep=8" in m] == [ep_search.ep_overrides(8, 8)]
    dense = tune.Tuner("configs/tiny.yaml", [], {"name": "h100-80g", "gpus_per_host": 8}, 16, 60, tmp_path, 0)
    assert not any(any(o.startswith("parallel.ep=") for o in m) for m in dense.meshes)
