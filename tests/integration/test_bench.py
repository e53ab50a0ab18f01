"""`jaxmem bench` on 8 CPU devices: planned bytes are the compiled executable's, timings and losses are
measured, nothing a CPU cannot measure is reported as a number, bad flags fail in one line before a compile."""
import json
import math
import statistics
from pathlib import Path

import pytest

from jaxmem import cli
from jaxmem.cli.bench import main
from jaxmem.config.targets import target_for_device_kind
from jaxmem.loader import load_config
from jaxmem.runtime.compiled_memory import memory_figures
from jaxmem.registry import build_program

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
SMALL = ["train.seq_len=32"]  # 8 devices (fsdp=-1) x 2 rows x 32 tokens


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "bench.json"
    assert main([TINY, *SMALL, f"out_dir={tmp / 'run'}", "--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    return tmp, json.loads(out.read_text())


def test_planned_bytes_are_the_compiled_steps(bench_run):
    _, r = bench_run
    cfg = load_config(TINY, SMALL)
    prog = build_program(cfg)
    figures = memory_figures(prog.lower().compile())  # the same program, compiled again (cache hit)
    mem, c = r["memory"], r["compiled"]
    assert mem["planned_device_bytes"]["value"] == figures["device"] == c["device_total"] > 0
    assert mem["planned_host_bytes"]["value"] == figures["host"] == 0
    assert {k: c[k] for k in ("argument", "output", "alias", "temp")} == \
        {k: figures[k] for k in ("argument", "output", "alias", "temp")}
    assert c["label"] == mem["planned_device_bytes"]["label"] == "compiled on this machine for cpu"
    # the step's arguments are the state (counted from its shards) and this device's batch rows
    batch = prog.grad_accum * (prog.rows // 8) * (cfg.train.seq_len + 1) * 4
    assert c["argument"] == mem["state_bytes_counted"]["value"] + batch


def test_timings_tokens_and_losses_are_consistent(bench_run):
    _, r = bench_run
    st = r["step_time"]["measured_seconds"]
    assert len(st["all_steps"]) == 3 and all(t > 0 for t in st["all_steps"])
    assert st["value"] == statistics.median(st["all_steps"][1:])
    assert r["tokens_per_step"]["value"] == 16 * 32
    assert r["tokens_per_second"]["value"] == pytest.approx(512 / st["value"], rel=1e-12)
    losses = r["losses"]["value"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.1  # chance level over the 256-token vocabulary
    assert r["device"]["devices"] == 8
    assert r["mfu"]["model_flops_per_step"] == r["cost"]["model_flops"] > 0


def test_cpu_reports_no_invented_figures(bench_run):
    tmp, r = bench_run
    mem = r["memory"]
    for key in ("measured_peak_bytes", "state_bytes_after_init", "peak_bytes_after_init"):
        assert mem[key]["value"] is None and mem[key]["note"] == "not available on cpu"
        assert mem[key]["label"] == "measured on CPU"
    assert mem["peak_over_planned"]["value"] is None
    assert r["mfu"]["value"] is None and r["mfu"]["label"] == "measured on CPU" and "6 x matmul" in r["mfu"]["how"]
    assert r["step_time"]["estimated_seconds"]["value"] is None
    assert r["step_time"]["measured_over_estimated"]["value"] is None
    assert r["step_time"]["estimated_seconds"]["label"].startswith("estimated (cost model")
    assert r["device"] == {**r["device"], "kind": "cpu", "platform": "cpu", "target": None,
                           "peak_flops_per_device": None}
    assert sorted(p.name for p in tmp.iterdir()) == ["bench.json"]  # no out_dir, no checkpoints


@pytest.mark.parametrize("args, named", [
    (["--steps", "0"], "--steps"),
    (["--steps", "3", "--warmup", "3"], "--warmup"),
    (["--warmup", "-1"], "--warmup"),
    (["train.stepz=3"], "train.stepz"),
])
def test_bad_input_is_one_line_naming_the_flag(args, named, capsys, tmp_path):
    assert cli.main(["bench", TINY, *args, "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err and err.startswith("jaxmem bench:"), err
    assert not list(tmp_path.iterdir())


def test_missing_config_is_one_line(capsys):
    assert cli.main(["bench", "no/such.yaml", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no/such.yaml" in err and "not found" in err


def test_target_for_device_kind():
    assert target_for_device_kind("NVIDIA H100 80GB HBM3").name == "h100-80g"
    assert target_for_device_kind("NVIDIA H200").name == "h200-141g"
    assert target_for_device_kind("NVIDIA GeForce RTX 4090").name == "rtx4090-24g"
    assert target_for_device_kind("nvidia  a100-sxm4-80gb").name == "a100-80g"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H200 NVL", "cpu", ""):  # other peaks, or none published
        assert target_for_device_kind(other) is None


def test_help_has_an_example(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "jaxmem bench configs/tiny.yaml" in out and "--warmup" in out and "docs/bench.md" in out
