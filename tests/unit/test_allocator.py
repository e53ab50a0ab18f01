"""Allocator settings derived from the plan (jaxmem.plan.allocator): exact values for each case."""
import json
from pathlib import Path

import pytest

from jaxmem.loader import load_config
from jaxmem.plan import allocator
from jaxmem.plan.bill import compute_bill
from jaxmem.config.targets import TARGETS

GIB = 2**30
H100 = TARGETS["h100-80g"].hbm_bytes  # 84,929,347,584 B = 79.1 GiB


def test_a_small_plan_keeps_the_default_fraction_and_turns_preallocation_off():
    s = allocator.derive(30 * GIB, H100, 0.10, "estimated (analytic)", environ={})
    assert s.env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}
    assert s.set_by_jaxmem == ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert s.limit_bytes == int(0.75 * H100) and s.warning is None


def test_a_tight_plan_raises_the_fraction_to_cover_it_plus_headroom():
    """67 GiB of 79.1: 0.847 + headroom 0.10 = 0.947, under the 0.95 cap; the default 0.75 would stop at 59.3."""
    s = allocator.derive(67 * GIB, H100, 0.10, "estimated (analytic)", environ={})
    assert s.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.947"
    assert s.limit_bytes == int(0.947 * H100) and s.limit_bytes > 67 * GIB and s.warning is None
    assert s.export_lines() == ["export XLA_PYTHON_CLIENT_PREALLOCATE=false",
                                "export XLA_PYTHON_CLIENT_MEM_FRACTION=0.947"]


def test_a_plan_over_the_cap_is_said_not_to_fit():
    s = allocator.derive(77 * GIB, H100, 0.10, "estimated (analytic)", environ={})
    assert s.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95" and s.limit_bytes == int(0.95 * H100)
    assert "the plan needs 77.0 GiB per device (estimated (analytic)), more than XLA may take (0.95 x 79.1 GiB " \
           "= 75.1 GiB)" in s.warning


def test_the_users_environment_wins_and_is_warned_about_when_it_cannot_hold_the_plan():
    user = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".75"}
    s = allocator.derive(67 * GIB, H100, 0.10, "estimated (analytic)", environ=user)
    assert s.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".75" and s.set_by_jaxmem == ("XLA_PYTHON_CLIENT_PREALLOCATE",)
    assert s.warning == ("XLA_PYTHON_CLIENT_MEM_FRACTION=.75 lets XLA use 59.3 GiB of 79.1 GiB, but the plan needs "
                         "67.0 GiB per device (estimated (analytic)): export XLA_PYTHON_CLIENT_MEM_FRACTION=0.947 or "
                         "unset it")
    platform = allocator.derive(67 * GIB, H100, 0.10, "x", environ={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert platform.limit_bytes is None and platform.warning is None


def test_the_compiled_total_comes_from_the_cache_else_a_subprocess_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXMEM_PLAN_CACHE", str(tmp_path / "cache"))
    cfg = load_config("configs/llama3-8b-8xh100.yaml")
    calls = []

    def fake_plan(cmd, **kw):  # what `jaxmem plan CONFIG --json OUT` writes, compiled for 8 x h100-80g
        calls.append(cmd)
        assert kw["env"]["JAX_PLATFORMS"] == "cpu" and cmd[3] == "plan"
        (Path(cmd[-1])).write_text(json.dumps({"config_hash": "from-the-file", "compiled": {
            "device_total": 70_000_000_000, "label": "compiled for 8 x h100-80g (deviceless)"}}))

    assert allocator.compiled_device_total(cfg, "h100-80g", 8, run=fake_plan) == (
        70_000_000_000, "compiled for 8 x h100-80g (deviceless)")
    assert allocator.compiled_device_total(cfg, "h100-80g", 8, run=fake_plan) == (
        70_000_000_000, "compiled for 8 x h100-80g (deviceless), cached by jaxmem plan")
    assert len(calls) == 1  # the second answer came from the cache
    # `jaxmem plan` of the same config writes the key the run looks up
    from jaxmem.config.schema import config_hash

    allocator.remember({"config_hash": config_hash(cfg, "8 x h100-80g"),
                        "compiled": {"device_total": 1, "label": "compiled for 8 x h100-80g (deviceless)"}})
    assert allocator.compiled_device_total(cfg, "h100-80g", 8, run=fake_plan)[0] == 1
    assert allocator.compiled_device_total(cfg, "h100-80g", 4, run=lambda *a, **k: None) is None  # failed: no JSON


def test_run_settings_come_from_the_configs_plan_and_are_applied_without_touching_the_users(tmp_path, monkeypatch,
                                                                                          capsys):
    cfg = load_config("configs/llama3-8b-8xh100.yaml", [f"out_dir={tmp_path}"])
    monkeypatch.setattr(allocator, "attached_gpus", lambda: (8, H100, "NVIDIA H100 80GB HBM3"))
    monkeypatch.setattr(allocator, "compiled_device_total", lambda cfg, target, n: None)  # the compile failed
    env = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    s = allocator.settings_for_run(cfg, env)
    bill = compute_bill(cfg, 8, gpu=True).device_total
    assert s.plan_bytes == bill and s.plan_how == "estimated (analytic)"
    assert s.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{min(0.95, max(0.75, round(bill / H100 + 0.10, 3))):g}"
    assert s.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"  # the user's
    applied = {}
    allocator.apply(s, applied)
    assert applied == {"XLA_PYTHON_CLIENT_MEM_FRACTION": s.env["XLA_PYTHON_CLIENT_MEM_FRACTION"]}
    assert allocator.settings_for_run(cfg, {"JAX_PLATFORMS": "cpu"}) is None  # nothing to set on CPU


def test_prepare_writes_the_settings_and_leaves_a_started_backend_alone(tmp_path, monkeypatch, capsys):
    """In the test process the CPU backend has started: prepare says so and changes nothing."""
    import jax

    jax.devices()
    cfg = load_config("configs/llama3-8b-8xh100.yaml", [f"out_dir={tmp_path}"])
    monkeypatch.setattr(allocator, "settings_for_run", lambda cfg: allocator.derive(67 * GIB, H100, 0.1, "x", {}))
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    allocator.prepare(cfg, "train", out_dir=tmp_path)
    assert "the backend already started; allocator settings left as they are" in capsys.readouterr().err
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in __import__("os").environ
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(allocator, "apply", lambda s: None)  # keep this process's environment
    allocator.prepare(cfg, "train", out_dir=tmp_path)
    out = capsys.readouterr().err
    assert "set XLA_PYTHON_CLIENT_PREALLOCATE=false; XLA_PYTHON_CLIENT_MEM_FRACTION=0.947 for 67.0 GiB" in out
    saved = json.loads((tmp_path / "allocator.json").read_text())
    assert saved["limit_bytes"] == int(0.947 * H100) and saved["export"][1].endswith("=0.947")


@pytest.mark.parametrize("fraction", ["abc"])
def test_an_unparsable_fraction_counts_as_the_default(fraction):
    s = allocator.derive(67 * GIB, H100, 0.1, "x", environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": fraction})
    assert s.limit_bytes == int(0.75 * H100) and "lets XLA use 59.3 GiB" in s.warning


@pytest.mark.parametrize("value", ["", None])
def test_an_empty_or_unset_cache_variable_means_the_default_directory(value, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("JAXMEM_PLAN_CACHE", raising=False)
    else:
        monkeypatch.setenv("JAXMEM_PLAN_CACHE", value)
    assert allocator.cache_dir() == tmp_path / ".cache" / "jaxmem" / "plans"
