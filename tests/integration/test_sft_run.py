"""A chat fine-tune end to end on CPU: packed chat JSONL with a held-out set, the loss falls, eval metrics reach
every output, a SIGKILLed run resumes exactly, and `jaxmem data --preview` shows what is trained."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import chat, write_tokenizer
from jaxmem.loader import load_config
from jaxmem.train.metrics import read_jsonl
from jaxmem.train import run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    for name, n in (("train.jsonl", 400), ("eval.jsonl", 40)):
        (root / name).write_text("".join(json.dumps({"messages": chat(rng)}) + "\n" for _ in range(n)))
    return root, write_tokenizer(root / "tok")


def _overrides(chats, out_dir, *extra):
    root, tokenizer = chats
    return [f"out_dir={out_dir}", "data.kind=jsonl", f"data.path={root / 'train.jsonl'}", f"data.tokenizer={tokenizer}",
            "data.format=messages", "data.packing=greedy", f"data.cache_dir={root / 'cache'}", "data.workers=1",
            f"eval.path={root / 'eval.jsonl'}", "eval.every=4", "eval.batches=2", "train.seq_len=64",
            "train.micro_batch=1", "parallel.fsdp=-1", "train.progress=false", "train.log_every=2",
            "optimizer.lr=3e-3", "optimizer.warmup_steps=2", *extra]


@pytest.mark.slow
def test_chat_fine_tune_learns_and_evaluates(chats, tmp_path, capsys, monkeypatch):
    """The loss falls, eval metrics reach the log, TensorBoard and (where wandb is installed) an offline wandb
    run, one run for every sink."""
    import importlib.util

    wandb = ["train.wandb=jaxmem-test"] if importlib.util.find_spec("wandb") else []
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(ROOT / "configs/tiny.yaml", _overrides(chats, tmp_path / "run", "train.steps=16",
                                                              "checkpoint.enabled=false", "train.tensorboard=true",
                                                              *wandb))
    summary = run(cfg)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.3
    assert evals[-1]["eval_ppl"] == pytest.approx(np.exp(evals[-1]["eval_loss"]), rel=1e-6)
    assert evals[0]["eval_tokens"] > 0 and all(r["eval_tokens"] == evals[0]["eval_tokens"] for r in evals)
    assert summary["records"][-1]["loss"] < summary["records"][0]["loss"]
    err = capsys.readouterr()
    assert "eval_loss" in err.out  # the plain log line
    assert "efficiency" in err.err  # the packing statistics, logged when the data is built
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))
    if wandb:
        runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
        assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def _losses(out_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(Path(out_dir) / "metrics.jsonl")}


@pytest.mark.slow
def test_sigkill_mid_run_resumes_exactly_on_packed_chat(chats, tmp_path):
    common = ["train.steps=10", "checkpoint.every=2", "train.log_every=1", "eval.every=0"]
    whole = run(load_config(ROOT / "configs/tiny.yaml", _overrides(chats, tmp_path / "whole", *common)))
    assert whole["final_step"] == 10
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "jaxmem.cli", "train", str(ROOT / "configs/tiny.yaml"),
           *_overrides(chats, killed, *common, "checkpoint.async_save=false")]
    env = dict(os.environ, JAXMEM_TEST_STEP_SLEEP="0.5")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (killed / "checkpoints" / "4").exists():
            time.sleep(0.2)
        assert (killed / "checkpoints" / "4").exists(), "the run never saved step 4"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    before = _losses(killed)
    assert max(before) < 10  # it really died mid-run
    resumed = run(load_config(ROOT / "configs/tiny.yaml", _overrides(chats, killed, *common)))
    assert 4 <= resumed["start_step"] < 10
    after = _losses(killed)  # the resumed records rewrite the steps after the checkpoint
    want = _losses(tmp_path / "whole")
    for step in range(resumed["start_step"] + 1, 11):
        assert after[step] == want[step], (step, after[step], want[step])


def test_data_preview_marks_the_trained_tokens(chats, tmp_path, capsys):
    from jaxmem import cli

    assert cli.main(["data", str(ROOT / "configs/tiny.yaml"), "--preview",
                     *_overrides(chats, tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "⟦" in out and "filled" in out
    marked = [part.split("⟧", 1)[0] for part in out.split("⟦")[1:]]
    assert marked and all("<|eot_id|>" in m and "<|start_header_id|>" not in m for m in marked)  # the turn
    # and its end-of-turn token are trained, the role header never
