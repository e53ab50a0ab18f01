"""`jaxmem tune`: the decision flow escalates until a compiled plan fits, never proposes what does not, writes a
config `jaxmem train` loads, says plainly when nothing fits, and verifies the winner with `jaxmem bench`."""
import json
from pathlib import Path

import pytest

from jaxmem import cli
from jaxmem.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


def _tune(tmp_path, *args, workers=1):
    out = tmp_path / "tuned.yaml"
    code = cli.main(["tune", *args, "--out", str(out), "--json", str(tmp_path / "tune.json"),
                     "--cache", str(tmp_path / "cache"), "--workers", str(workers)])
    result = json.loads((tmp_path / "tune.json").read_text())
    return code, out, result


@pytest.mark.slow
def test_flow_escalates_to_offload_on_a_24gb_gpu(tmp_path, capsys):
    pytest.importorskip("jax_cuda12_plugin")
    code, out, result = _tune(tmp_path, str(ROOT / "configs/llama3-8b-1x4090.yaml"), "--target", "rtx4090-24g",
                              "--gpus-per-host", "1", "--plot", str(tmp_path / "pareto.png"))
    assert code == 0
    path = " -> ".join(result["path"])
    assert path.startswith("bf16 mixed precision: no candidate fits") and "activation recomputation: no" in path
    best = result["best"]
    assert "offload.params=host" in best["overrides"]  # 8B weights + AdamW do not fit 24 GB otherwise
    row = best["row"]
    assert row["fits"] is True and row["device_bytes"] <= row["usable_device_bytes"]
    assert row["device_bytes_basis"] == "compiled"
    for cand in result["candidates"]:  # nothing that does not fit its own compiled figure was proposed
        if cand["compiled"] and cand["fits"]:
            assert cand["compiled"]["device_bytes"] <= cand["compiled"]["usable_device_bytes"]
    cfg = load_config(out)  # the written config is a full config `jaxmem train` loads as is
    assert cfg.offload.params == "host" and cfg.remat.preset == "offload_layer_inputs"
    assert cfg.precision.param_dtype == "bfloat16" and cfg.precision.master_weights
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert "chose " in capsys.readouterr().out


@pytest.mark.slow
def test_nothing_fits_says_so_and_names_the_closest(tmp_path, capsys):
    pytest.importorskip("jax_cuda12_plugin")
    code, out, result = _tune(tmp_path, str(ROOT / "configs/tiny.yaml"), "model.preset=llama3-70b",
                              "train.seq_len=2048", "parallel.fsdp=1", "--target", "rtx4090-24g",
                              "--gpus-per-host", "1", "--budget-s", "60")
    assert code == 1 and not out.exists() and result["best"] is None
    text = capsys.readouterr().out
    assert "nothing fits on 1 x rtx4090-24g" in text and "closest: " in text
    assert "params=host" in text.split("closest: ")[1]  # the lever that came closest


@pytest.mark.slow
def test_verify_runs_bench_on_the_winner(tmp_path, capsys):
    pytest.importorskip("jax_cuda12_plugin")
    # the mesh is pinned (fsdp=8): one layout per lever keeps the flow short
    code, out, result = _tune(tmp_path, str(ROOT / "configs/tiny.yaml"), "train.seq_len=64", "parallel.fsdp=8",
                              "--target", "h100-80g", "--gpus-per-host", "8", "--global-batch", "16", "--verify",
                              workers=0)
    assert code == 0
    path = result["path"]
    assert path[0].startswith("bf16 mixed precision: fits")  # a tiny model fits without any lever
    assert any(p.startswith("micro-batch") for p in path)  # then the micro-batch is raised
    text = capsys.readouterr().out
    assert "verify: planned" in text and "measured on CPU" in text


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    assert cli.main(["tune", str(ROOT / "configs/tiny.yaml"), "--global-batch", "0"]) == 2
    assert "--global-batch: must be >= 1" in capsys.readouterr().err
    assert cli.main(["tune", str(ROOT / "configs/tiny.yaml")]) == 2  # no target: tune plans for a GPU
    assert "needs a GPU target" in capsys.readouterr().err


def test_each_candidate_is_one_line_of_at_most_120_characters():
    from types import SimpleNamespace

    from jaxmem.cli.tune import BF16, RESET, Candidate
    from jaxmem.cli.tune_report import table

    row = {"device_bytes": 70 * 2**30, "host_bytes": 900 * 2**30, "fits": True, "host_fits": True,
           "step_seconds_estimated": 1.0, "tokens_per_step": 10**9, "status": "planned"}
    short = Candidate(BF16 + RESET + ["parallel.dp=1", "parallel.tp=1", "parallel.rules=fsdp", "parallel.fsdp=8",
                                      "train.micro_batch=1", "train.grad_accum=4"], "bf16", row=row)
    long = Candidate(BF16 + RESET + ["remat.preset=offload_layer_inputs", "remat.seq_tile=16384",
                                     "offload.optimizer=host", "offload.optimizer_update=device",
                                     "offload.params=host", "parallel.fsdp=4", "parallel.tp=2",
                                     "parallel.zero_stage=3", "train.micro_batch=16", "train.grad_accum=1"],
                     "parameters offloaded", row=row)
    assert short.label == "fsdp=8 micro_batch=1 grad_accum=4"  # the axes at 1 and the implied rules left out
    lines = table(SimpleNamespace(candidates=[short, long]))
    assert len(lines) == 3 and all(len(line) <= 120 for line in lines)
    assert lines[1].endswith("  fsdp=8 micro_batch=1 grad_accum=4") and "1,000,000,000" in lines[1]
    assert lines[2].endswith("...") and "preset=offload_layer_inputs seq_tile=16384" in lines[2]
def test_the_optimizer_state_is_searched_only_when_lossy_is_allowed(tmp_path):
    """Without --allow-lossy-optimizer no candidate touches precision.moment_dtype (the config's own is kept);
    with it a stage of int8 / int4 moments (with and without the fp32 master) runs after recomputation and
    before any offload, every other candidate starting from fp32 moments; the note says which."""
    from jaxmem.cli import tune

    def tuner(allow):
        return tune.Tuner(str(ROOT / "configs/tiny.yaml"), ["precision.moment_dtype=int8"],
                          {"name": "h100-80g", "gpus_per_host": 8},
                          None, 60.0, tmp_path / "cache", 0, allow_lossy=allow)

    kept, lossy = tuner(False), tuner(True)
    assert [name for name, _ in kept.stages] == [name for name, _ in tune.STAGES]
    names = [name for name, _ in lossy.stages]
    assert names.index("optimizer state quantized (lossy)") == names.index("activation recomputation") + 1
    assert names.index("optimizer state quantized (lossy)") < names.index("optimizer state offloaded")
    for name, levers in kept.stages:
        for cand in kept.stage_candidates(name, levers):
            assert not any(o.startswith("precision.moment") for o in cand.overrides)
    cands = lossy.stage_candidates(*tune.LOSSY_STAGE)
    assert {o for c in cands for o in c.overrides if o.startswith("precision.moment_dtype=")} == {
        "precision.moment_dtype=float32", "precision.moment_dtype=int8", "precision.moment_dtype=int4"}
    assert all(c.overrides.index("precision.moment_dtype=float32") < c.overrides.index(
        next(o for o in c.overrides if o in ("precision.moment_dtype=int8", "precision.moment_dtype=int4")))
        for c in cands)  # the lossy lever comes after the reset, so it wins
    assert "not searched" in tune.optimizer_note(False) and "--allow-lossy-optimizer" in tune.optimizer_note(True)
