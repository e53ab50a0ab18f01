"""Pipeline schedules and layer partitions: the order of a schedule's steps, layer counts and their errors,
the levers a pipeline refuses, and splitting a state into stages and back. No program is built."""
import jax
import numpy as np
import pytest

from jaxmem.config import ConfigError
from jaxmem.loader import load_config
from jaxmem.pipeline import partition, schedule


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
