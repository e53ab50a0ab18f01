"""jaxmem.plan.figure_cache: a deviceless compile's figures kept by lowered text + target + versions + flags."""
import pytest

from jaxmem.loader import load_config
from jaxmem.plan import figure_cache


def test_the_key_changes_with_each_thing_the_compile_reads(monkeypatch):
    base = figure_cache.key("module @step {}", "1 x h100-80g")
    assert base == figure_cache.key("module @step {}", "1 x h100-80g")
    assert base != figure_cache.key("module @step { }", "1 x h100-80g")
    assert base != figure_cache.key("module @step {}", "1 x h200-141g")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false")
    assert base != figure_cache.key("module @step {}", "1 x h100-80g")
    monkeypatch.setattr("jax.__version__", "0.0.1")
    flags_only = figure_cache.key("module @step {}", "1 x h100-80g")
    monkeypatch.undo()
    assert flags_only != base


def test_off_without_a_directory(monkeypatch, tmp_path):
    monkeypatch.delenv(figure_cache.ENV, raising=False)
    figure_cache.store("k", {"temp": 1}, [], 1.0)
    assert figure_cache.lookup("k") is None and not any(tmp_path.iterdir())
    monkeypatch.setenv(figure_cache.ENV, str(tmp_path / "figures"))
    assert figure_cache.lookup("k") is None
    figure_cache.store("k", {"temp": 1}, ["over budget"], 1.234)
    assert figure_cache.lookup("k") == {"fields": {"temp": 1}, "warnings": ["over budget"], "compile_seconds": 1.23}


@pytest.mark.slow
def test_a_second_plan_of_the_same_step_reads_the_first_compiles_figures(monkeypatch, tmp_path):
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime.aot import resolve_topology
    from jaxmem.plan.compiled import compile_for_plan

    monkeypatch.setenv(figure_cache.ENV, str(tmp_path))
    cfg = load_config("configs/tiny.yaml", ["parallel.fsdp=2", "train.seq_len=32"])
    topo = resolve_topology(cfg, "h100-80g", 2, 1)
    compiled, first = compile_for_plan(cfg, topo)
    assert compiled is not None and len(list(tmp_path.glob("*.json"))) == 2  # the step and its init
    again, second = compile_for_plan(cfg, topo)
    assert again is None  # nothing compiled
    assert second.fields == first.fields and second.warnings == first.warnings and second.label == first.label
    assert second.init.fields == first.init.fields and first.init.device_total > 0
    assert first.fields["temp"] > 0 and first.device_total == compiled.memory_analysis().temp_size_in_bytes + \
        compiled.memory_analysis().argument_size_in_bytes + compiled.memory_analysis().output_size_in_bytes - \
        compiled.memory_analysis().alias_size_in_bytes
