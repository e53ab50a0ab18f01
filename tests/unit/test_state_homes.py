"""Lever decisions read the layout's resolved homes (jaxmem.core.offload.StateHomes, Layout.homes), not the
config's `offload.*` strings: the bill and the cost model follow a layout whose homes say otherwise."""
import dataclasses

import pytest

from jaxmem.loader import load_config
from jaxmem.config.targets import get_target
from jaxmem.registry import resolve_layout as resolve
from jaxmem.core.offload import StateHomes, host_keys
from jaxmem.plan import costmodel
from jaxmem.plan.bill import compute_bill

BASE = ["parallel.fsdp=1", "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16",
        "precision.master_weights=true", "remat.preset=full", "target.name=h100-80g", "target.gpus_per_host=1"]


@pytest.mark.parametrize("offload,homes,keys", [
    ([], ("device", "device", "device"), ()),
    (["offload.optimizer=host", "offload.optimizer_update=device"], ("device", "host", "device"), ("opt", "master")),
    (["offload.optimizer=host", "offload.optimizer_update=host"], ("device", "host", "host"), ("opt", "master")),
    (["offload.params=host", "offload.optimizer=host", "offload.optimizer_update=host"], ("host", "host", "host"),
     ("opt", "master", "params")),
])
def test_homes_resolve_offload_once(offload, homes, keys):
    cfg = load_config("configs/tiny.yaml", BASE + offload)
    got = StateHomes.from_config(cfg)
    assert (got.params, got.optimizer, got.update) == homes
    assert got.host_keys() == keys == host_keys(cfg)
    layout = resolve(cfg, 1, "gpu")
    assert layout.homes == got and layout.host_state == keys
    assert got.update_streamed == (homes[1] == "host" and homes[2] == "device")


def test_bill_and_cost_model_decide_from_the_layout_homes():
    device_cfg = load_config("configs/tiny.yaml", BASE)
    host_cfg = load_config("configs/tiny.yaml", BASE + ["offload.optimizer=host", "offload.optimizer_update=host"])
    on_host = resolve(host_cfg, 1, "gpu")
    # the device config's layout with the host config's homes: the bill follows the layout, not cfg.offload
    swapped = dataclasses.replace(resolve(device_cfg, 1, "gpu"), homes=on_host.homes, host_state=on_host.host_state)
    expected, got = compute_bill(host_cfg, 1, layout=on_host), compute_bill(device_cfg, 1, layout=swapped)
    assert got.host["temporaries"] == expected.host["temporaries"] > 0
    assert got.device == expected.device
    gpu = get_target("h100-80g")
    t_expected = costmodel.time_breakdown(host_cfg, expected, gpu, 1, 1, expected.layout.rows)
    t_got = costmodel.time_breakdown(device_cfg, got, gpu, 1, 1, got.layout.rows)
    assert t_got["host_bytes_serial"] == t_expected["host_bytes_serial"] > 0
    assert t_got["memory_bound_seconds"] == pytest.approx(t_expected["memory_bound_seconds"])
